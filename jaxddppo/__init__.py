"""jaxddppo: decentralized distributed PPO in JAX."""

__version__ = "0.1.0"

"""jaxddppo: decentralized distributed PPO in JAX."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `import jaxddppo` stays light, and `python -m jaxddppo.train`
    # does not find its own module imported already.
    if name == "load_policy":
        from jaxddppo.policy import load_policy

        return load_policy
    raise AttributeError(f"module 'jaxddppo' has no attribute {name!r}")

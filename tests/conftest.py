"""Four simulated CPU devices for every test process (set before JAX is imported)."""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"

if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=4".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

"""The age of this process, from the kernel's record of its start (Linux).

benchmarks/learning.py puts its curves on one seconds axis from each trial's process start, so
that start-up, imports and compiling count; a peer trial reads the age of its own process with
this, where the driver times the jaxddppo command from the moment it starts it.
"""

from __future__ import annotations

import os
import time

# /proc/PID/stat's fields after the command name's closing parenthesis: the third field (state) is
# the first of them, so the 22nd (starttime, in clock ticks after boot) is at index 19.
START_TIME_INDEX = 19


def process_age_seconds() -> float:
    """Seconds since this process started, to the kernel's clock tick (10 ms on most systems)."""
    with open("/proc/self/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    started = int(fields[START_TIME_INDEX]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started

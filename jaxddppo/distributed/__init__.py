"""Where a run runs: its sizes over shards, devices and processes (`topology`), and joining a
multi-process run (`multiprocess`).
"""

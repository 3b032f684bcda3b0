"""The CPU switch (`run.cpu_tuning`), its kernels and the CPU backend's devices and threads (`tuning`).
"""

"""What runs the algorithm: a population's compiled programs (`experiment`, `population`, `pbt`,
`eval_episodes`), the host loop (`loop`, `chunk_metrics`), checkpoints and storage faults
(`checkpoint`, `storage`) and the compilation cache (`compile_cache`).
"""

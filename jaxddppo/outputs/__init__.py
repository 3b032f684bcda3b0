"""What a run leaves: its directory (`run_dir`), metrics, progress and summaries (`writers`), and a
trained policy loaded back (`policy`).
"""

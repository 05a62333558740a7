"""Many scenarios at once: sweeps and the planner on any Executor, with an on-disk
cache by content hash.
"""

"""Data parallelism with ZeRO-1/2: DDP's gradient buckets, sharded reductions, the
optimizer step and the parameter all-gather after it.
"""

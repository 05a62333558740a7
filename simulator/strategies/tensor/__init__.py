"""Tensor (and sequence) parallelism: Megatron-LM's collectives around each block, DTensor's
functional collectives, and TP communication overlap (``overlap``).
"""

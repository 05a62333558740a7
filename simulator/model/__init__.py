"""The transformer as arithmetic: parameters, FLOPs, the op inventory every cost and
memory figure reads, and the memory each rank holds.
"""

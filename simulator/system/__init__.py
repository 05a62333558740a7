"""The machine: hardware profiles, the topology and network of links, the cost model
that prices ops, and the collective algorithms with NCCL's own selection.
"""

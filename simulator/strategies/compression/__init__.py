"""Data-parallel gradient compression (PowerSGD, 1-bit Adam, bf16/fp8 wires): what
each method puts on the wire, computes and keeps (``arithmetic``) and its tasks
(``workload``).
"""

"""Collective algorithms as plans: which link class carries how many bytes per rank,
in how many latency steps.

``plan`` holds the data (a plan is phases of concurrent legs), one module per algorithm
(``ring``, ``tree``, ``hierarchical``, ``pairwise``, ``direct``, ``nvls``, ``pat``)
its textbook and NCCL forms, ``registry`` lists them, ``tuner`` is NCCL's choice among
them for ``auto``, ``choice`` makes the plan of one collective and ``cost`` prices it.
"""

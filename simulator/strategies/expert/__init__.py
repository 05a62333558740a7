"""Expert parallelism for a mixture of experts: the routed experts split over ep
ranks, the all-to-alls, the expert grid's groups (``layer``) and uneven loads.
"""

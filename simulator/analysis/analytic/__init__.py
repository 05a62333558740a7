"""The closed form of a step: one micro-batch through each stage (``stage``), the
pipeline phase and what follows it (``estimate``), the oracle the engine is tested
against where the closed form is exact and the fast path for sweeps and plans.
"""

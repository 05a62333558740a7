"""Calibration and measured runs: PyTorch microbenchmarks that fit a hardware profile,
and real TP/PP/DP runs of a small GPT to compare against the simulation.

torch is imported lazily inside functions, so ``import calibration`` works without it.
"""

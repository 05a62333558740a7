"""Calibration and measured runs, two products in two subpackages:

- :mod:`calibration.microbench`: PyTorch microbenchmarks that fit a hardware
  profile (``clustersim calibrate``);
- :mod:`calibration.measured`: real TP/PP/DP runs of a small GPT to compare
  against the simulation (``clustersim measure``, ``compare``, ``validation``).

:mod:`calibration.host` holds what both share (CPU name, torchrun launches);
measured profiles live in ``calibration/profiles/``. torch is imported lazily
inside functions, so ``import calibration`` works without it.
"""

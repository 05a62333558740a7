"""Calibration and measured runs, two products in two subpackages:

- :mod:`calibration.microbench`: PyTorch microbenchmarks that fit a hardware
  profile (``clustersim calibrate``);
- :mod:`calibration.measured`: real TP/PP/DP runs of a small GPT to compare
  against the simulation (``clustersim measure``, ``compare``, ``validation``).

What both share sits here: :mod:`calibration.host` (PyTorch, the CPU's name, torchrun
launches) and :mod:`calibration.commands` (the commands the CLI discovers); which bundled
preset a CUDA device is comes from the simulator's one table
(:mod:`simulator.system.devices`); measured profiles live in
``calibration/profiles/``. torch is imported lazily inside functions, so
``import calibration`` works without it.
"""

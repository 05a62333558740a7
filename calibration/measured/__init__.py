"""Measured runs of a small GPT: ``clustersim measure`` trains it with real TP / PP /
DP under torchrun and records step times and a compute / communication split;
``clustersim compare`` simulates the same scenario with a calibrated profile and
reports the errors; ``clustersim validation`` does both for a fixed set of
configurations and writes the validation table (docs/validation.md).

Entry points :mod:`calibration.measured.measure`, :mod:`calibration.measured.compare`,
:mod:`calibration.measured.validation` and :mod:`calibration.measured.host_cost`; the
torchrun workers are :mod:`calibration.measured.parallel_worker` (TP / PP / DP),
``moe_worker`` and ``cp_worker``, which share :mod:`calibration.measured.worker_run` and
its timing helpers, :mod:`calibration.measured.timing`.
"""

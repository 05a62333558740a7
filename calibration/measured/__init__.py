"""Measured runs of a small GPT: ``clustersim measure`` trains it with real TP / PP /
DP under torchrun and records step times and a compute / communication split;
``clustersim compare`` simulates the same scenario with a calibrated profile and
reports the errors; ``clustersim validation`` does both for a fixed set of
configurations and writes the README's validation table.

Entry points :mod:`calibration.measured.measure`, :mod:`calibration.measured.compare`
and :mod:`calibration.measured.validation`; the torchrun worker is
:mod:`calibration.measured.parallel_worker`.
"""

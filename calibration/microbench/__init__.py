"""Microbenchmarks and fitting: ``clustersim calibrate`` measures GEMMs, attention,
memory-bound kernels and collectives on this machine (or reads nccl-tests output),
fits efficiency curves and α-β collective costs, and writes a hardware profile;
``clustersim calibrate report`` plots measured against fitted.

Entry point :mod:`calibration.microbench.calibrate`. Measuring: the compute benchmarks
(``bench_*``), the collectives' torchrun launch (:mod:`~calibration.microbench.
bench_collectives`, its worker :mod:`~calibration.microbench.collectives_worker` and the
helpers it shares, :mod:`~calibration.microbench.dist`) and the two-rank terms measured in
it (:mod:`calibration.microbench.terms`, one module each, in a registry). Fitting:
:mod:`~calibration.microbench.fit` (the curves and α-β), ``fit_terms``, ``fit_profile``
and ``spread``; :mod:`~calibration.microbench.profile_build` writes the profile.
"""

"""Microbenchmarks and fitting: ``clustersim calibrate`` measures GEMMs, attention,
memory-bound kernels and collectives on this machine (or reads nccl-tests output),
fits efficiency curves and α-β collective costs, and writes a hardware profile;
``clustersim calibrate report`` plots measured against fitted.

Entry point :mod:`calibration.microbench.calibrate`; the torchrun worker is
:mod:`calibration.microbench.collectives_worker`.
"""

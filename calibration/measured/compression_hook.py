"""Gradient compression in a measured run: PyTorch's PowerSGD DDP communication hook.

:func:`register_powersgd` registers ``powerSGD_hook``
(``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``) on a
``DistributedDataParallel`` model with the run's rank, PyTorch's defaults for
everything else (``min_compression_rate`` 2, error feedback and warm start on)
and ``start_powerSGD_iter`` equal to the run's untimed warm-up steps, so every
timed step (and the profiled one) is compressed: the hook all-reduces plainly
while its iteration count is below the start, and counts one iteration per step.
PowerSGDState refuses a start below 2 with error feedback, hence ``warmup >= 2``
(:func:`calibration.measured.measure_config.validate`). The simulator's side of
the same run is ``training.gradient_compression: {method: powersgd, rank: r,
start_step: warmup}`` (:mod:`simulator.strategies.compression.arithmetic`).
"""

from __future__ import annotations

from typing import Any

#: DDP bucket cap of a PowerSGD run, MB: one bucket holds the whole small GPT. With
#: gloo the hook's continuations (the P and Q all-reduces) are issued from gloo's
#: completion thread, so with several buckets they race the next bucket's first
#: all-reduce, issued by the autograd thread, and the two ranks can issue them in
#: different orders (gloo aborts: "Received data size doesn't match expected size",
#: seen with the default 25 MB buckets). The scenario sets ``dp_bucket_MB`` to match.
POWERSGD_BUCKET_MB = 1000


def powersgd_ddp_options() -> dict[str, Any]:
    """DDP keywords of a PowerSGD run: one gradient bucket."""
    return {"bucket_cap_mb": POWERSGD_BUCKET_MB}


def register_powersgd(ddp: Any, rank: int, start_step: int) -> Any:
    """Register PowerSGD on ``ddp`` (rank ``rank``); returns the hook's state."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    state = psgd.PowerSGDState(
        process_group=ddp.process_group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=start_step,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
    )
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return state

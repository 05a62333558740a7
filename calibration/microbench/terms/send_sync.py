"""The send sync cost: what a point-to-point send costs after compute, beyond its
back-to-back time.

The collective benchmark times send/recv as a ring shift between barriers: both
ranks hot and aligned, each send met by a receive already posted. A pipeline's
sends follow compute: the stage posts its sends (``isend``) and its receives
(``irecv``) one by one and blocks on the receive's ``wait`` (``_batch_p2p`` and
``_wait_batch_p2p`` in PyTorch's ``torch/distributed/pipelining/schedules.py``), so
the receiver sleeps until the data lands and the communication threads (gloo's
``ProcessGroupGloo::runLoop`` in ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``,
NCCL's kernel on a GPU) wake for each message. This measures that cost in the same
torchrun launch and on the same group of two ranks as
:mod:`calibration.microbench.terms.collective_sync`, with its burst and round machinery
(:mod:`calibration.microbench.terms.burst`).
For each message size S (the collective sync's sizes), in rounds:

1. ``alone``: K compute bursts (square GEMMs, about 1 ms), their median, per rank;
2. ``with``: K iterations of a ping-pong, their mean: rank 0 runs the burst and
   sends S bytes to rank 1, which waits on its receive, runs the same burst and
   sends S bytes back, on which rank 0 waits; each rank times every iteration;
3. ``b2b``: K send/recv ring shifts of S bytes, each after a group barrier, as the
   collective benchmark times ``send_recv``, their median.

One iteration holds one burst of each rank and two sends, which the simulator
charges as two bursts and two back-to-back send/recvs; a rank's excess per send is
``(with − 2·alone − 2·b2b) / 2``. Both ranks time the same cycle, each against its
own burst, so a round's excess at S is the ranks' mean (:func:`round_excess`: with
ranks of unequal speed the mean charges each burst once), ``b2b`` the quiet time over
the rounds (:func:`calibration.microbench.terms.collective_sync.charged_b2b`: what the
collective benchmark keeps and the simulator charges). As for the collective, a
size's figure is the median over rounds and ``gpu.send_sync_us`` the median over the
sizes, at least 0 (:func:`sync_seconds`). One node holds one link class,
``intra_node``; the inter-node figure stays the preset's (none).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from calibration.microbench.bench_results import latest_rounds, link_of
from calibration.microbench.dist import human, make_call, timed_loop
from calibration.microbench.spread import rounds_spread
from calibration.microbench.terms import collective_sync as cs
from calibration.microbench.terms.burst import make_burst, sweep

ITERATIONS = cs.ITERATIONS
ROUNDS = cs.ROUNDS
KIND = "send_sync"
OP = "send_recv"
FLAG = "--send-sync"
HELP = "also time sends after compute (a ping-pong) against back to back (ranks 0, 1)"
#: what the profile's ``provenance.fit`` keeps of the record (shaped as the collective's)
FIT_FIELDS = cs.FIT_FIELDS


# ---------------------------------------------------------------- the figure (no torch)


def round_excess(row: dict[str, Any]) -> float:
    """Seconds per send beyond back to back at one size in one round: the ranks' mean
    of ``(with − 2·alone − 2·b2b) / 2``."""
    return statistics.fmean((w - 2 * a - 2 * c) / 2 for a, w, c in
                            zip(row["alone_s"], row["with_s"], row["b2b_s"], strict=True))


def excess_by_size(rec: dict[str, Any]) -> dict[int, float]:
    """Each size's median excess per send over the rounds, seconds, by bytes."""
    return cs.excess_by_size(rec, round_excess)


def sync_seconds(rec: dict[str, Any]) -> float:
    """The figure: the median over sizes of :func:`excess_by_size`, at least 0."""
    return cs.sync_seconds(rec, round_excess)


def round_figures(rec: dict[str, Any]) -> list[float]:
    """Each round's median excess over its sizes: the samples of the figure's spread."""
    return cs.round_figures(rec, round_excess)


# ---------------------------------------------------------------- measuring


def key(device: str, threads: int) -> str:
    return f"{device}/t{threads}/send_sync/intra_node/send_recv/n2"


sync_key = key  # its name before the registry (tests key records by it)


def summary(rec: dict[str, Any]) -> str:
    sizes = ", ".join(f"{human(s)} {t * 1e6:.0f} us" for s, t in excess_by_size(rec).items())
    return (f"[send sync] burst {rec['burst_s'] * 1e3:.2f} ms; excess per send after compute "
            f"{sizes}: {sync_seconds(rec) * 1e6:.0f} us")


def rounds(device: str, group: Any, dev: str) -> dict[str, Any]:
    """The record's measurements, on ranks 0 and 1 of ``group`` (each runs this)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = 1 - rank
    burst, meta = make_burst(device, group, dev, cs.BURST_S)

    def ping_pong(size: int) -> Callable[[], None]:
        out, back = torch.zeros(size // 4, device=dev), torch.empty(size // 4, device=dev)

        def call() -> None:
            if rank == 0:
                burst()
                req = dist.isend(out, peer, group=group)
                _wait(dist.irecv(back, peer, group=group))
                _wait(req)
            else:
                _wait(dist.irecv(back, peer, group=group))
                burst()
                _wait(dist.isend(out, peer, group=group))
        return call

    def shift(size: int) -> Callable[[], None]:
        call, _, _ = make_call("send_recv", 2, size, group, dev, rank)
        return lambda: call(0)

    sizes = cs.SIZES[device]
    loops = {s: (timed_loop(burst, group, dev), timed_loop(ping_pong(s), group, dev),
                 timed_loop(shift(s), group, dev, aligned=True)) for s in sizes}
    return {**meta, "iterations": ITERATIONS, "sizes": list(sizes),
            "rounds": sweep(loops, group, dev, ROUNDS, ITERATIONS)}


def _wait(work: Any) -> None:
    """Block on a send's or a receive's work (None: the rank is not in the group)."""
    if work is not None:
        work.wait()


# ---------------------------------------------------------------- the fit (no torch)


def fit(records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any] | None]:
    """The send sync cost in seconds per link class, from the latest successful record
    (and that record)."""
    rec = latest_rounds(records)
    return ({}, None) if rec is None else ({link_of(rec): sync_seconds(rec)}, rec)


def uncertainty(rec: dict[str, Any] | None) -> float | None:
    """The standard error of the rounds' figures relative to the figure."""
    return rounds_spread(rec, sync_seconds, round_figures)


def provenance(rec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Samples (rounds) and what ``provenance.terms`` says of the record: its excess per
    send by size."""
    return len(rec["rounds"]), {"link": rec.get("link", "intra_node"),
                                "by_size_us": {s: round(t * 1e6, 1)
                                               for s, t in excess_by_size(rec).items()}}

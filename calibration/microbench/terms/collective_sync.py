"""The collective sync cost: what a blocking collective costs after compute, beyond its
back-to-back time.

The collective benchmark times calls back to back between barriers: both ranks hot
and aligned. In training every collective follows compute, so the communication
threads (gloo's workers, ``ProcessGroupGloo::runLoop`` in PyTorch's
``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``; NCCL's kernel on a GPU) must wake
and the ranks arrive with the skew of their own timing noise, the earlier one waiting
(the noise a collective amplifies: Hoefler, Schneider and Lumsdaine, SC 2010). This
measures that cost inside the collective benchmark's torchrun launch
(:mod:`calibration.microbench.collectives_worker`), on its group of two ranks, so no
extra processes start. Both ranks, in rounds, for each message size S
(:data:`SIZES`):

1. ``alone``: K iterations of a compute burst (square GEMMs, about 1 ms), their
   median;
2. ``with``: K iterations of the same burst, each followed by a blocking all-reduce
   of S bytes, their mean (a step pays every iteration, its slow ones too);
3. ``b2b``: K all-reduces of S bytes, each after a group barrier as the collective
   benchmark times them (both ranks hot and aligned), their median.

What is subtracted is what the simulator already charges: the compute benchmark keeps
medians of single calls (a CPU call of 0.2 ms or more is timed on its own), and the
collective benchmark the quiet time of its rounds, the second-best round's median
(:func:`calibration.microbench.dist.quiet_time`). So ``b2b`` enters as
the same estimator over this record's rounds (:func:`charged_b2b`, per rank and size),
never as the round's own median: gloo's back-to-back all-reduce of 1 MiB swings between
~1 and ~3 ms from round to round on a 2-core VM while the all-reduce after compute
stays at 2-4 ms, and a slow round's own b2b took its slowness off the excess (the figure
read 0.7 ms where the collectives of a measured TP step take 2.8 ms, median, from the
later rank's issue to completion, against ~1.1 ms back to back). The excess holds what
the α-β fit misses, heavy tail included. Each loop starts after a group barrier and
each iteration is timed to a device synchronisation (on a GPU the excess then reads one
synchronisation short). A rank's excess is ``with − alone − b2b``; a round's is the
slowest rank's (:func:`round_excess`), a size's the median over rounds, and the
figure (``gpu.collective_sync_us``) the median over the sizes, at least 0
(:func:`sync_seconds`). The cost grows with the message (every profile of this
project's VM read it rising from 4 KiB to 1 MiB: 538 → 1271, 704 → 1371, 767 → 1035,
479 → 896 µs), so the per-size medians are the profile's curve too
(``gpu.collective_sync_curve``, :func:`sync_curve`), which the simulator reads at each
collective's bytes in place of the one figure; on a CPU the sizes reach 16 MiB
(:data:`SYNC_SIZES`), a small GPT's ZeRO-3 layer. One node holds one link class,
``intra_node``; the inter-node figure stays the preset's (none).

The cost also grows with the compute before the collective. On this project's 2-core VM
the all-reduce of 1 MiB, timed from the later rank's arrival to its end, took a median
2.2 ms after 1 ms of GEMMs, 2.5 ms after 4 ms, 3.0 ms after 16 ms (0.9 ms back to
back); after a busy-wait of the same lengths 1.9, 3.2 and 3.7 ms; after a sleep of the
same lengths 2.3, 1.3 and 1.6 ms: it is busy time, not idle time, that grows it. A TP
step's collectives follow several milliseconds of compute, a DDP step's first bucket
most of the backward. So on a CPU the same ``alone``/``with`` loops run after longer
bursts (:data:`BURSTS`, at :data:`BURST_SIZES`, the rounds' ``b2b`` charged alike), and
the growth over the 1 ms burst's excess, the median over those sizes, at least 0, is the
profile's ``gpu.collective_sync_burst`` (:func:`burst_curve`): 0 at the 1 ms burst,
interpolated in log(burst), flat beyond. The engine charges it at each collective from
its members' compute since their previous collective
(:func:`simulator.system.collectives.cost.sync_burst_cost`).

It shrinks after shorter bursts too. On the project's 2-vCPU AMD EPYC VM the all-reduce
of 64 KiB cost, beyond back to back, a mean 0.17-0.29 ms after no compute or 0.1 ms of
GEMMs, 0.4-0.6 ms after 0.25-0.5 ms and 0.9 ms after 1 ms (256 KiB: 0.54-0.60, 0.9-1.1 and
0.9 ms); and in the profiler trace of a tiny-gpt TP 2 step with sequence parallelism the
functional collectives' issue-to-done time grew with the host time before them: a mean
0.9-1.0 ms after 0.1-0.7 ms, 1.7 ms after 0.7-1.5 ms, 2.3 ms after 1.5-4 ms. A tiny
model's collectives follow a few hundred microseconds of compute, so on a CPU the loops
also run after shorter bursts (of a smaller GEMM, :data:`SHORT_GEMM_SIZE`), whose change
from the base, at most 0, enters the curve below the 1 ms burst: a discount, which the
engine never lets exceed the sync cost itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from calibration.microbench.bench_results import latest_rounds, link_of
from calibration.microbench.dist import gather, human, quiet_time, timed_loop
from calibration.microbench.spread import rounds_spread
from calibration.microbench.terms.burst import make_burst, sweep

BURST_S = 1e-3  # the compute between two collectives, as a layer's GEMMs in a small model
SIZES = {"cpu": (4 << 10, 256 << 10, 1 << 20), "cuda": (64 << 10, 1 << 20, 16 << 20)}
#: the collective sync cost's own sizes: the common ones (which the send and DTensor sync
#: costs share) and up to a layer's ZeRO-3 gather on a CPU, where the cost grows with
#: the message (a 12.6 MB all-gather after compute: 1-2 ms against 0.5-0.8 ms at 4 KiB)
SYNC_SIZES = {"cpu": SIZES["cpu"] + (4 << 20, 16 << 20), "cuda": SIZES["cuda"]}
#: the other bursts, seconds, shorter and longer than BURST_S, and the sizes they run at
#: (none on a GPU: not measured)
BURSTS = {"cpu": (1e-4, 3e-4, 4e-3, 16e-3), "cuda": ()}
#: the GEMM of a burst shorter than BURST_S: fine enough to make 0.1 ms of a few
SHORT_GEMM_SIZE = {"cpu": 128, "cuda": 1024}
BURST_SIZES = {"cpu": (256 << 10, 1 << 20), "cuda": ()}
ITERATIONS = 16
ROUNDS = 9  # gloo on a shared VM has slow spells: the median round shrugs off a few
KIND = "collective_sync"
OP = "all_reduce"
FLAG = "--collective-sync"
HELP = "also time all-reduces after compute against back to back (ranks 0, 1)"
#: what the profile's ``provenance.fit`` keeps of the record
FIT_FIELDS: tuple[str, ...] = ("burst_s", "gemms", "iterations", "sizes")


# ---------------------------------------------------------------- the figure (no torch)


def round_excess(row: dict[str, Any]) -> float:
    """Seconds per collective beyond back to back at one size in one round, the
    slowest rank's: max over ranks of ``with − alone − b2b``."""
    return max(w - a - c for a, w, c in zip(row["alone_s"], row["with_s"], row["b2b_s"],
                                            strict=True))


#: A round's excess at one size from its row (:func:`round_excess` for a collective).
RowExcess = Callable[[dict[str, Any]], float]


def charged_b2b(rec: dict[str, Any]) -> dict[int, list[float]]:
    """Per size, each rank's back-to-back time as the simulator charges it: the quiet
    time over the record's rounds (the second-best round's median, as the collective
    benchmark keeps), by bytes (none for a term timed against another collective after
    the same burst, whose rows have no ``b2b_s``)."""
    by: dict[int, list[list[float]]] = {}
    for rnd in rec["rounds"]:
        for row in rnd:
            if "b2b_s" in row:
                by.setdefault(int(row["bytes"]), []).append(row["b2b_s"])
    return {s: [quiet_time(list(r)) for r in zip(*rows, strict=True)]
            for s, rows in by.items()}


def charged_rounds(rec: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The record's rounds with each row's ``b2b_s`` replaced by :func:`charged_b2b` (a row
    without one as it is)."""
    b2b = charged_b2b(rec)
    return [[{**row, "b2b_s": b2b[int(row["bytes"])]} if "b2b_s" in row else row
             for row in rnd] for rnd in rec["rounds"]]


def excess_by_size(rec: dict[str, Any], excess: RowExcess = round_excess) -> dict[int, float]:
    """Each size's median excess over the rounds, seconds, by bytes."""
    by: dict[int, list[float]] = {}
    for rnd in charged_rounds(rec):
        for row in rnd:
            by.setdefault(int(row["bytes"]), []).append(excess(row))
    return {s: statistics.median(v) for s, v in sorted(by.items())}


def sync_seconds(rec: dict[str, Any], excess: RowExcess = round_excess) -> float:
    """The figure: the median over sizes of :func:`excess_by_size`, at least 0."""
    return max(statistics.median(excess_by_size(rec, excess).values()), 0.0)


def sync_curve(rec: dict[str, Any]) -> list[tuple[int, float]]:
    """The cost by size: each size's median excess (:func:`excess_by_size`), at least 0,
    as (bytes, seconds) in increasing size (``gpu.collective_sync_curve``)."""
    return [(size, max(t, 0.0)) for size, t in excess_by_size(rec).items()]


def burst_excess(rec: dict[str, Any]) -> dict[float, float]:
    """Per other burst (seconds, the record's ``burst_rounds``), the growth of the excess
    over the base burst's: per size, the median over rounds of :func:`round_excess` (the
    base rounds' ``b2b`` charged) minus that size's :func:`excess_by_size`; the median over
    the sizes. Empty for a record without longer bursts."""
    base, b2b = excess_by_size(rec), charged_b2b(rec)
    by: dict[float, dict[int, list[float]]] = {}
    for rnd in rec.get("burst_rounds") or []:
        for row in rnd:
            size = int(row["bytes"])
            if size in base and size in b2b:
                by.setdefault(float(row["burst_s"]), {}).setdefault(size, []).append(
                    round_excess({**row, "b2b_s": b2b[size]}))
    return {burst: statistics.median(statistics.median(v) - base[size]
                                      for size, v in sizes.items())
            for burst, sizes in sorted(by.items())}


def burst_curve(rec: dict[str, Any], spread: float = 0.0) -> list[tuple[float, float]]:
    """The growth by burst as (seconds of compute, seconds), from 0 at the base burst
    (``gpu.collective_sync_burst``): at least 0 after a longer burst, at most 0 (a
    discount) after a shorter one; empty without other bursts.

    A burst's ``with`` holds the wait for the slower rank, which the profile's rank
    spread c already charges as compute (each op of a two-rank step ``1 + c · e_2``
    times as long, :mod:`calibration.microbench.terms.rank_spread`): over the base burst B₀
    that is c · e_2 · (B − B₀), taken off here so that the two terms do not count the
    same wait twice.

    More compute before a collective never makes it cheaper (every measurement of this
    project's VMs rises with the burst, each burst's figure one noisy median: the
    0.15 ms burst read 0 and the 0.37 ms one −632 µs in one calibration), so each side
    of the base burst is the non-decreasing least-squares fit to its figures
    (:func:`monotone`) before the bounds."""
    from simulator.system.costs import expected_max_normal

    grown = burst_excess(rec)
    if not grown:
        return []
    b0, e2 = float(rec["burst_s"]), expected_max_normal(2)
    def side(shorter: bool) -> list[tuple[float, float]]:
        """One side of the base burst, its figures less the spread's, fit non-decreasing."""
        bs = sorted(b for b in grown if (b < b0) == shorter and b != b0)
        return list(zip(bs, monotone([grown[b] - spread * e2 * (b - b0) for b in bs]),
                        strict=True))

    return [(b, min(t, 0.0)) for b, t in side(True)] + [(b0, 0.0)] \
        + [(b, max(t, 0.0)) for b, t in side(False)]


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (isotonic
    regression by pooling adjacent violators: a run that decreases becomes its mean)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(int(n))]


def round_figures(rec: dict[str, Any], excess: RowExcess = round_excess) -> list[float]:
    """Each round's median excess over its sizes: the samples of the figure's spread."""
    return [statistics.median(excess(row) for row in rnd) for rnd in charged_rounds(rec)]


# ---------------------------------------------------------------- measuring


def key(device: str, threads: int) -> str:
    return f"{device}/t{threads}/collective_sync/intra_node/all_reduce/n2"


sync_key = key  # its name before the registry (tests key records by it)


def summary(rec: dict[str, Any]) -> str:
    sizes = ", ".join(f"{human(s)} {t * 1e6:.0f} us" for s, t in excess_by_size(rec).items())
    grown = "".join(f"; after {b * 1e3:.3g} ms {t * 1e6:+.0f} us"
                    for b, t in burst_excess(rec).items())
    return (f"[collective sync] burst {rec['burst_s'] * 1e3:.2f} ms; excess after compute "
            f"{sizes}: {sync_seconds(rec) * 1e6:.0f} us{grown}")


def rounds(device: str, group: Any, dev: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    # zeros: a sum repeated hundreds of times stays finite (random values would reach inf)
    bufs = {s: torch.zeros(s // 4, device=dev) for s in SYNC_SIZES[device]}
    burst, meta = make_burst(device, group, dev, BURST_S)

    def reduce(buf: Any, after_burst: bool) -> Callable[[], None]:
        def call() -> None:
            if after_burst:
                burst()
            dist.all_reduce(buf, group=group)
        return call

    loops = {s: (timed_loop(burst, group, dev), timed_loop(reduce(buf, True), group, dev),
                 timed_loop(reduce(buf, False), group, dev, aligned=True))
             for s, buf in bufs.items()}
    out = {**meta, "iterations": ITERATIONS, "sizes": list(SYNC_SIZES[device]),
           "rounds": sweep(loops, group, dev, ROUNDS, ITERATIONS)}
    at = {s: bufs[s] for s in BURST_SIZES[device] if s in bufs}
    longer = [longer_rounds(group, dev, device, b, at) for b in BURSTS[device]] if at else []
    if longer:
        out["burst_rounds"] = [[row for per_burst in longer for row in per_burst[r]]
                               for r in range(ROUNDS)]
    return out


def longer_rounds(group: Any, dev: str, device: str, burst_s: float,
                  bufs: Mapping[int, Any]) -> list[list[dict[str, Any]]]:
    """``ROUNDS`` rounds of ``alone`` and ``with`` after a burst of ``burst_s`` (of the
    smaller GEMM where it is shorter than the base burst) at each
    size of ``bufs``: per round, one row per size (``burst_s``, ``bytes``, every rank's
    median ``alone`` and mean ``with``)."""
    import torch.distributed as dist

    burst, meta = make_burst(device, group, dev, burst_s,
                             SHORT_GEMM_SIZE[device] if burst_s < BURST_S else None)

    def reduce(buf: Any) -> Callable[[], None]:
        def call() -> None:
            burst()
            dist.all_reduce(buf, group=group)
        return call

    alone = timed_loop(burst, group, dev)
    withs = {s: timed_loop(reduce(buf), group, dev) for s, buf in bufs.items()}
    alone(1)
    for loop in withs.values():
        loop(1)
    out = []
    for _ in range(ROUNDS):
        base = statistics.median(alone(ITERATIONS))
        rows = []
        for s, loop in withs.items():
            times = [base, statistics.fmean(loop(ITERATIONS))]
            rows.append({"bytes": s, "burst_s": meta["burst_s"],
                         **dict(zip(("alone_s", "with_s"), gather(times, group, dev),
                                    strict=True))})
        out.append(rows)
    return out


# ---------------------------------------------------------------- the fit (no torch)


def fit(records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any] | None]:
    """The sync cost in seconds per link class, from the latest successful record (and
    that record)."""
    rec = latest_rounds(records)
    return ({}, None) if rec is None else ({link_of(rec): sync_seconds(rec)}, rec)


def curve_by_link(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The sync cost by size per link class (:func:`sync_curve`), from the latest
    successful record; none with fewer than two sizes."""
    rec = latest_rounds(records)
    if rec is None:
        return {}
    curve = sync_curve(rec)
    return {link_of(rec): curve} if len(curve) > 1 else {}


def burst_by_link(records: list[dict[str, Any]], spread: float = 0.0,
                  ) -> dict[str, list[tuple[float, float]]]:
    """The sync cost's growth by compute burst per link class (:func:`burst_curve`, less
    what a rank ``spread`` already charges), from the latest successful record; none
    without longer bursts."""
    rec = latest_rounds(records)
    if rec is None:
        return {}
    curve = burst_curve(rec, spread)
    return {link_of(rec): curve} if len(curve) > 1 else {}


def uncertainty(rec: dict[str, Any] | None) -> float | None:
    """The standard error of the rounds' figures relative to the figure."""
    return rounds_spread(rec, sync_seconds, round_figures)


def provenance(rec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Samples (rounds) and what ``provenance.terms`` says of the record: its excess by
    size and, where longer bursts were timed, its growth by the burst's milliseconds."""
    out: dict[str, Any] = {"link": rec.get("link", "intra_node"),
                           "by_size_us": {s: round(t * 1e6, 1)
                                          for s, t in excess_by_size(rec).items()}}
    if rec.get("burst_rounds"):
        out["growth_by_burst_us"] = {f"{b * 1e3:.3g} ms": round(t * 1e6, 1)
                                     for b, t in burst_excess(rec).items()}
    return len(rec["rounds"]), out

"""The rank spread: how much slower the slower of two ranks runs the same compute.

Two ranks given the same work do not finish it together: on a shared VM one core
has a noisy neighbour for a while, on a GPU node one device clocks lower (Sinha et
al., "Not All GPUs Are Created Equal", SC 2022, measure a few percent between GPUs
of one model). Every synchronisation of a step waits for the slowest rank, so the
noise a rank's compute carries is amplified at each collective (Hoefler, Schneider
and Lumsdaine, SC 2010), and the wait grows with the compute since the last one: in
a measured small-gpt TP 2 step on the project's 2-core VM the ranks reach each
all-reduce a mean 1.5 ms apart after 7-16 ms of compute and 6.5 ms apart after
25-105 ms. The collective sync cost (:mod:`calibration.microbench.terms.collective_sync`)
holds what one collective costs after a 1 ms burst; this holds the part that scales
with the compute before it.

Measured in the collective benchmark's torchrun launch, on its group of two ranks:
in :data:`ROUNDS` rounds, :data:`ITERATIONS` times, both ranks start the same burst
of square GEMMs (about :data:`SEGMENT_S`, a layer's share of a small model's step)
after a group barrier and each times its own burst to a device synchronisation. An
iteration's excess is ``(max − mean) / mean`` of the two ranks' times; a round's the
mean over its iterations and the figure the mean over rounds (a step pays the slow
spells too: on the VM one rank runs 5-10% behind for seconds at a time, which a
median over rounds would drop). With the ranks' times normal with relative spread
c, the excess of the slower of n is ``c · e_n``, e_n the expected maximum of n
standard normals (``e_2 = 1/√π``); the profile keeps ``gpu.rank_spread = excess /
e_2``, and the cost model scales every compute op of an n-rank step by
``1 + c · e_n`` (:func:`simulator.system.costs.expected_max_normal`).
"""

from __future__ import annotations

import statistics
from typing import Any

from calibration.microbench.bench_results import latest_rounds
from calibration.microbench.dist import timed_loop
from calibration.microbench.spread import mean_rel_se
from calibration.microbench.terms.burst import make_burst

SEGMENT_S = {"cpu": 16e-3, "cuda": 2e-3}  # the compute between two synchronisations
ITERATIONS = 12
ROUNDS = 9
KIND = "rank_spread"
OP = "compute"
FLAG = "--rank-spread"
HELP = "also time the same compute burst on two ranks at once (ranks 0, 1)"
#: what the profile's ``provenance.fit`` keeps of the record
FIT_FIELDS: tuple[str, ...] = ("burst_s", "gemms", "iterations")


# ---------------------------------------------------------------- the figure (no torch)


def round_excesses(rec: dict[str, Any]) -> list[float]:
    """Each round's mean over its iterations of ``(max − mean) / mean`` of the ranks'
    burst times."""
    out = []
    for rnd in rec["rounds"]:
        per_iter = []
        for times in zip(*rnd, strict=True):  # one iteration: every rank's seconds
            mean = statistics.fmean(times)
            if mean > 0:
                per_iter.append((max(times) - mean) / mean)
        if per_iter:
            out.append(statistics.fmean(per_iter))
    return out


def excess(rec: dict[str, Any]) -> float:
    """The mean over rounds of :func:`round_excesses`, at least 0: how much longer the
    slower rank's burst took than the ranks' mean."""
    rounds = round_excesses(rec)
    return max(statistics.fmean(rounds), 0.0) if rounds else 0.0


def spread(rec: dict[str, Any]) -> float:
    """The relative spread c of one rank's compute time (``gpu.rank_spread``): the
    excess over the expected maximum of the record's ranks' standard normals."""
    from simulator.system.costs import expected_max_normal

    return excess(rec) / expected_max_normal(int(rec.get("nranks", 2)))


# ---------------------------------------------------------------- measuring


def key(device: str, threads: int) -> str:
    return f"{device}/t{threads}/rank_spread/n2"


spread_key = key  # its name before the registry (tests key records by it)


def summary(rec: dict[str, Any]) -> str:
    return (f"[rank spread] burst {rec['burst_s'] * 1e3:.1f} ms; the slower rank "
            f"{excess(rec) * 100:.1f}% over the mean: spread {spread(rec):.3f}")


def rounds(device: str, group: Any, dev: str) -> dict[str, Any]:
    """The record's measurements on ranks 0 and 1 of ``group`` (each runs this): per
    round, per rank, its :data:`ITERATIONS` burst times."""
    import torch
    import torch.distributed as dist

    burst, meta = make_burst(device, group, dev, SEGMENT_S[device])
    together = timed_loop(burst, group, dev, aligned=True)  # each burst after a barrier
    together(1)  # warm-up
    out = []
    for _ in range(ROUNDS):
        mine = torch.tensor(together(ITERATIONS), dtype=torch.float64, device=dev)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        out.append([t.tolist() for t in every])
    return {**meta, "iterations": ITERATIONS, "rounds": out}


# ---------------------------------------------------------------- the fit (no torch)


def fit(records: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any] | None]:
    """The rank spread (relative σ of a rank's compute time), from the latest successful
    record (and that record)."""
    rec = latest_rounds(records)
    return (None, None) if rec is None else (spread(rec), rec)


def uncertainty(rec: dict[str, Any] | None) -> float | None:
    """The standard error of the rounds' excesses relative to their mean."""
    return mean_rel_se(round_excesses(rec) if rec else [])


def provenance(rec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Samples (rounds) and what ``provenance.terms`` says of the record."""
    return len(rec["rounds"]), {"excess": round(excess(rec), 4), "burst_s": rec.get("burst_s")}

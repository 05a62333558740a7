"""The simulation of a scenario cut into the trace classes, per rank, for one step.

The same interval algebra as the measured side (:mod:`simulator.traces.measured`), over
the engine's span table: a rank's communication spans (each span's kind a
communication kind; its collective kind from the op, ``tp.all_reduce`` →
``all_reduce``) start where the rank reaches the collective, peer-wait included, as an
NCCL kernel's time in a trace does; ``compute`` is the union of the other spans,
``exposed_comm`` the communication outside it, ``idle`` the step outside every span.

The engine runs a layer's ops as one compute span, so the compute classes split each
rank's non-optimizer compute by its stage's op inventory (:mod:`simulator.outputs.
ops_table`): each op's priced time, a layer's ops times the layers the stage holds, the
embedding on the first stage and the head on the last, folded into trace classes by
:data:`simulator.traces.classes.COST_CLASS_TRACE`. The optimizer's spans are
``elementwise``; an offload's transfers are ``memcpy``; what the host stream computes (an
offloaded optimizer's CPU step) is no device time and counts nowhere.

A folded run simulates one rank per class of identical ranks; a measured rank that
was not simulated is set beside its stage's simulated rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import pandas as pd

from simulator.analysis.accounting.vocabulary import comm_kinds
from simulator.builder.workload import layout_of
from simulator.spec.placement import holds_embedding, holds_head, stage_layer_count
from simulator.spec.scenario import Scenario
from simulator.traces.classes import (
    COMM_CLASSES,
    COMPUTE_CLASSES,
    COST_CLASS_TRACE,
    MEMCPY,
    SIMULATED_MEMCPY_KINDS,
    comm_kind,
)
from simulator.traces.intervals import Interval, length, subtract, union

HOST_STREAM = "host"


def class_shares(s: Scenario, stage: int) -> dict[str, float]:
    """Each compute class's share of one micro-batch's compute on pipeline ``stage``."""
    from simulator.outputs.ops_table import op_rows

    rows = op_rows(s)
    parts = {r["part"] for r in rows if str(r["part"]).startswith("layer")}
    layers = stage_layer_count(s.model.layers, s.parallel, stage,
                              s.model.mtp_layers) / max(len(parts), 1)
    weight = {"embedding": float(holds_embedding(s.parallel, stage)),
              "head": float(holds_head(s.parallel, stage))}
    time: dict[str, float] = dict.fromkeys(COMPUTE_CLASSES, 0.0)
    for r in rows:
        w = layers if r["part"] in parts else weight.get(r["part"], 0.0)
        time[COST_CLASS_TRACE[r["class"]]] += w * r["time_us"]
    total = sum(time.values())
    return {c: time[c] / total if total else 0.0 for c in COMPUTE_CLASSES}


def _intervals(rows: pd.DataFrame) -> list[Interval]:
    return union(zip(rows["start"].tolist(), rows["end"].tolist(), strict=True))


def span_figures(spans: pd.DataFrame, step: float, shares: Mapping[str, float]
                 ) -> dict[str, float]:
    """One simulated rank's figures (seconds in its step; see the module notes)."""
    kinds = set(comm_kinds())
    kind = spans["kind"].astype(str)
    copies = spans[kind.isin(SIMULATED_MEMCPY_KINDS)]
    comm_rows = spans[kind.isin(kinds - SIMULATED_MEMCPY_KINDS)]
    # the host's own work (an offloaded optimizer's CPU step) is no kernel of the device
    compute_rows = spans[~kind.isin(kinds) & (spans["stream"].astype(str) != HOST_STREAM)]
    optimizer = kind.loc[compute_rows.index] == "optimizer"
    per: dict[str, list[Interval]] = defaultdict(list)
    for op, rows in comm_rows.groupby(comm_rows["op"].astype(str).map(comm_kind)):
        per[str(op)] = _intervals(rows)
    per[MEMCPY] = _intervals(copies)
    opt = _intervals(compute_rows[optimizer])
    rest = length(subtract(_intervals(compute_rows[~optimizer]), opt))
    out = {c: length(per[c]) for c in (*COMM_CLASSES, MEMCPY)}
    for c in COMPUTE_CLASSES:
        out[c] = rest * shares.get(c, 0.0) + (length(opt) if c == "elementwise" else 0.0)
    compute = _intervals(compute_rows)
    comm = union(iv for c in COMM_CLASSES for iv in per[c])
    busy = union([*compute, *comm, *per[MEMCPY]])
    out.update(compute=length(compute), comm=length(comm),
               exposed_comm=length(subtract(comm, compute)), idle=step - length(busy),
               step=step)
    for c in COMM_CLASSES:
        out[f"bytes_{c}"] = float(comm_rows.loc[comm_rows["op"].astype(str).map(comm_kind)
                                                == c, "bytes"].sum())
    return out


def simulated_rank(s: Scenario, spans: pd.DataFrame, rank: int) -> int:
    """The simulated rank that stands for ``rank``: itself, else its stage's first."""
    simulated = spans["rank"].unique()
    if rank in simulated:
        return rank
    stage = layout_of(s).coord(rank).pp
    same = spans.loc[spans["stage"] == stage, "rank"]
    return int(same.min())


def simulated_figures(s: Scenario, results: Mapping[str, Any], spans: pd.DataFrame,
                      ranks: list[int]) -> dict[int, dict[str, float]]:
    """Each of ``ranks``' simulated figures (its stand-in's), with ``sim_rank``."""
    step = float(results["step_time_s"])
    shares: dict[int, dict[str, float]] = {}
    cache: dict[int, dict[str, float]] = {}
    out = {}
    for rank in ranks:
        sim = simulated_rank(s, spans, rank)
        if sim not in cache:
            stage = layout_of(s).coord(sim).pp
            if stage not in shares:
                shares[stage] = class_shares(s, stage)
            cache[sim] = span_figures(spans[spans["rank"] == sim], step, shares[stage])
        out[rank] = {**cache[sim], "sim_rank": float(sim)}
    return out

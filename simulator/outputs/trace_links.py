"""What a trace shows beyond its spans, for a selection of ranks: flows and counters.

Computed once from a finished simulation for the ranks the trace will show
(``--trace-ranks``), and handed to :mod:`simulator.outputs.trace_export` as flat
tables, so the exporter still never sees a simulation object. Three things:

- **flows** (:attr:`TraceLinks.flows`, one row per endpoint: ``flow`` id,
  ``task``, ``phase`` "s" or "f", ``cat``): each pipeline send to the compute
  task on the receiving rank that waited for it (the send is one of the
  compute's dependencies), and each collective's members — the spans that
  share a ``group_key`` — joined by one flow from the member that arrived last
  (whose arrival released the others) to each other member. Only endpoints on
  selected ranks count: a flow needs both ends in the trace.
- **link utilisation** (:attr:`TraceLinks.links`: ``rank``, ``link``, ``t``,
  ``value``, a step function per rank and link class): every transfer a rank
  takes part in puts its wire bytes on each link class — a send its payload on
  the class between the two ranks, a collective the per-rank bytes of its
  plan's legs — at the transfer's mean rate, from the moment the whole group
  had arrived (``SimResult.begin``) to its end; the value is the sum of
  those rates over the class's per-GPU rate. A rank's transfers that run at
  once share the link (the network divides it), so the sum of their means can
  pass 1 where one starts or ends inside another.
- **memory** (:attr:`TraceLinks.memory`): each rank's allocated bytes over the
  step, :func:`simulator.analysis.memory_timeline.memory_timeline`'s curves.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from simulator.analysis.memory_timeline import Curve, memory_timeline
from simulator.builder.tasks import Task
from simulator.engine.result import SimResult
from simulator.spec.scenario import Scenario
from simulator.system.topology import Topology


@dataclass
class TraceLinks:
    ranks: list[int]
    flows: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        {"flow": [], "task": [], "phase": [], "cat": []}))
    links: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        {"rank": [], "link": [], "t": [], "value": []}))
    memory: Curve = field(default_factory=list)


def _rank_tasks(result: SimResult, ranks: Sequence[int]) -> list[Task]:
    programs = result.workload.programs
    return [t for r in ranks for tasks in programs[r].streams.values() for t in tasks]


def _flows(result: SimResult, tasks: list[Task], where: dict[int, tuple[float, float]],
           ) -> pd.DataFrame:
    """Send → waiting compute, and last-arrived member → other members (module notes)."""
    all_tasks = result.workload.tasks
    rows: list[tuple[int, int, str, str]] = []
    groups: dict[tuple[Any, ...], list[Task]] = defaultdict(list)
    for t in tasks:
        for d in t.deps:
            dep = all_tasks[d]
            if dep.dst >= 0 and dep.rank != t.rank and d in where:
                flow = len(rows) // 2
                rows += [(flow, d, "s", dep.kind), (flow, t.id, "f", dep.kind)]
        if t.plan is not None:
            groups[t.group_key].append(t)
    for members in groups.values():
        if len(members) < 2:
            continue
        last = max(members, key=lambda m: (where[m.id][0], -m.rank))
        for m in members:
            if m is not last:
                flow = len(rows) // 2
                rows += [(flow, last.id, "s", m.kind), (flow, m.id, "f", m.kind)]
    return pd.DataFrame(rows, columns=["flow", "task", "phase", "cat"])


def _wire_bytes(task: Task, topo: Topology) -> dict[str, float]:
    """Bytes a transfer puts on each link class, per rank."""
    if task.dst >= 0:
        return {topo.link_class(task.rank, task.dst): task.nbytes}
    out: dict[str, float] = defaultdict(float)
    assert task.plan is not None
    for phase in task.plan.phases:
        for leg in phase.legs:
            out[leg.link_class] += leg.bytes_per_rank
    return out


def _link_load(result: SimResult, s: Scenario, tasks: list[Task],
               where: dict[int, tuple[float, float]]) -> pd.DataFrame:
    """Per rank and link class, utilisation as a step function (module notes)."""
    topo = Topology(result.workload.layout, s.hardware)
    deltas: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    transfer = result.begin  # by task id, NaN but for collectives (not the cached dict of
    # every collective, 1.7 GB at 16,384 GPUs full, for the few ranks traced)
    for t in tasks:
        if t.plan is None and t.dst < 0:
            continue
        start, end = where[t.id]
        begin = float(transfer[t.id])
        begin = start if np.isnan(begin) else begin
        if end <= begin:
            continue
        for link, nbytes in _wire_bytes(t, topo).items():
            if nbytes > 0:
                rate = nbytes / (end - begin) / topo.rate(link)  # type: ignore[arg-type]
                deltas[t.rank, link] += [(begin, rate), (end, -rate)]
    frames = []
    for (rank, link), steps in sorted(deltas.items()):
        ds = pd.DataFrame(steps, columns=["t", "d"]).groupby("t", sort=True)["d"].sum()
        times, value = ds.index.to_numpy(), np.array(ds.cumsum(), dtype=float)
        value[np.abs(value) < 1e-9] = 0.0  # sums of + and - rates leave rounding, not load
        if times[0] > 0:  # the counter starts idle at 0
            times, value = np.concatenate([[0.0], times]), np.concatenate([[0.0], value])
        frames.append(pd.DataFrame({"rank": rank, "link": link, "t": times, "value": value}))
    return pd.concat(frames, ignore_index=True) if frames else TraceLinks([]).links


def trace_links(s: Scenario, result: SimResult, spans: pd.DataFrame, ranks: Sequence[int],
                memory: Curve | None = None) -> TraceLinks:
    """Flows, link utilisation and memory curves of ``ranks`` (simulated ranks), with
    times from ``spans`` (the run's span table). ``memory`` may hold curves already
    computed (results.json's); the other ranks' are computed."""
    tasks = _rank_tasks(result, ranks)
    rows = spans[spans["rank"].isin(list(ranks))]
    where = dict(zip(rows["task"].tolist(),
                     zip(rows["start"].tolist(), rows["end"].tolist(), strict=True),
                     strict=True))
    wanted = set(ranks)
    have = {int(c["rank"]): c for c in (memory or []) if int(c["rank"]) in wanted}
    missing = [r for r in ranks if r not in have]
    if missing:
        for curve in memory_timeline(s, result, ranks=missing, spans=spans):
            have[int(curve["rank"])] = curve
    return TraceLinks(
        ranks=list(ranks),
        flows=_flows(result, tasks, where),
        links=_link_load(result, s, tasks, where),
        memory=[have[r] for r in ranks if r in have],
    )

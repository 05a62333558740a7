"""Allocated memory over the step, per simulated rank, replayed from the trace.

:mod:`simulator.model.memory` gives each stage's memory as a sum of per-component peaks;
this module puts the same quantities on the simulated timeline, so a rank's curve shows
*when* its memory is held. The bytes are memory.py's, the times are the spans':

- **static** (held all step): the stage's weights, gradients, optimizer states and device
  terms (:mod:`simulator.model.device_memory`) exactly as
  :func:`~simulator.analysis.memory.stage_breakdown` counts them, and with DDP / ZeRO-1/2
  (dp > 1) its two gradient-bucket buffers (allocated when DDP wraps the model).
- **activations**: one layer of one micro-batch,
  :func:`~simulator.model.memory.activation_bytes_per_layer` (recompute and sequence
  parallelism included), allocated when that layer's forward ends and freed when its
  backward for the micro-batch ends: B, or I for ZB-H1 — the same choice as memory.py and
  :meth:`Schedule.peak_in_flight` (what W still needs, the weight-gradient inputs, is not
  counted by either). The first virtual stage adds the embedding dropout mask (b·s·h bytes
  in 16-bit, divided by t with sequence parallelism) from the embedding's forward to its
  backward; the last adds 4 b·s·h (final-norm and logits-GEMM inputs) and what the loss
  saves (:func:`~simulator.model.memory.loss_tensors`: the fp32 logits, 4 b·s·V / t, or
  flash-attn's 16-bit ones) from the head's forward to its backward, its gradient copies
  while the head's backward runs, and a trainer's metrics' logits and temporaries while they
  run (:func:`~simulator.model.memory.metric_tensors`).
- **ZeRO-3 / FSDP** (dp > 1): a layer's gathered 16-bit parameters (layer_params / t × dtype
  bytes) are allocated when an all-gather of that layer starts and freed after the forward
  that used it when ``reshard_after_forward`` (else after the micro-batch's backward of the
  layer), or after the backward that used a backward gather. Buffers are per layer: a layer
  gathered again while still resident (forward and prefetched backward gather of the same
  layer) is held once. One layer's unsharded gradient is held while its weight gradient is
  computed (the B blocks, or W), and for the micro-batch whose backward triggers the layer's
  reduce-scatter, until that reduce-scatter ends. The stage's root unit
  (:func:`~simulator.strategies.zero3.buffers.zero3_root_bytes`: embedding, head) is held
  from its gather's start to the end of the micro-batch's backward (FSDP2 keeps its root
  gathered for the backward, reshards it after), once however many micro-batches overlap; on
  the last stage the output layer's unsharded gradient from the end of the head's B (the
  loss's copies freed first, as memory.py's moments have it) or the start of its W until the
  root's reduce-scatter ends. The embedding's gradient, made at the backward's end, is not
  counted (nor by memory.py).

At one timestamp the allocations made by work that ended there are applied first and the
curve records that value, then the frees and the allocations made by work starting there (a
forward's activations exist before FSDP reshards the unit it used; a prefetch is issued
after the previous unit was freed). What is not modelled, as in memory.py: the working set
of a recomputed layer, autograd temporaries, optimizer-step temporaries, the allocator's
fragmentation.

Agreement with memory.py (tests/test_memory_timeline.py): docs/memory.md.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from simulator.analysis.curves import MAX_POINTS, Point, downsample
from simulator.analysis.memory import stage_breakdown
from simulator.analysis.timeline_marks import Marks, scan
from simulator.builder.tasks import Task
from simulator.engine.result import SimResult
from simulator.model import memory as mem
from simulator.model import transformer as mdl
from simulator.model.inventory.mtp import mtp_kept
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import zero3_collectives
from simulator.spec.recompute import keeps, layer_mode, policy
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.buffers import zero3_root_bytes
from simulator.strategies.zero3.deferred import deferred

TIME_TOL = 1e-9  # of the step time: events closer than this are simultaneous

# what each allocation is made of; the curve's value is sum(count × bytes) + static
# (then one component per distinct size of a layer's activations, :func:`layer_components`)
_EMBED, _HEAD, _DLOGITS, _UNIT, _GRAD, _ROOT, _ROOT_GRAD, _METRICS, _ACC, _ROOT_ACC = range(10)
# at one timestamp: allocations by ending work, then frees, then allocations by starting work
_END_ALLOC, _FREE, _START_ALLOC = range(3)

Curve = list[dict[str, Any]]


def component_bytes(s: Scenario) -> dict[str, float]:
    """Bytes of one allocation of each kind on one GPU (memory.py's formulas)."""
    spec, par, trn = s.model, s.parallel, s.training
    b, t, sp, dt = trn.micro_batch, par.tp, par.sequence_parallel, trn.dtype
    tokens_h = b * spec.seq_len * spec.hidden * dtype_bytes(dt) / 2 / (t if sp else 1)
    saved, gradients = mem.loss_tensors(s)
    return {
        "activation_layer": mem.activation_bytes_per_layer(spec, b, t, sp, policy(par), dt,
                                                          stack=s.stack),
        # embedding dropout mask (first virtual stage), when the stack drops out
        "embed": tokens_h if s.stack.hidden_dropout > 0 else 0.0,
        # final-norm + logits-GEMM inputs, the loss's saved tensors (last), again per MTP
        # module with its norms' and projection's inputs
        "head": (4 * tokens_h + saved) * (1 + spec.mtp_layers)
        + spec.mtp_layers * mtp_kept(spec, b, t, sp, dt, s.stack, par.recompute),
        "dlogits": gradients,  # the loss gradient's copies while the head's backward runs
        "metrics": mem.metric_tensors(s),  # the trainer's metrics' logits and temporaries
        # a ZeRO-3 gathered layer, or one of its modules' parts (the stack's ZeRO-3 unit)
        "unit": mdl.layer_params(spec) / t * dtype_bytes(dt)
        / zero3_collectives(spec, s.stack),
        # a layer's gradients accumulated unsharded in the reduce dtype (deferred ZeRO-3)
        "accumulated": mdl.layer_params(spec) / t * s.stack.reduce_bytes(dtype_bytes(dt)),
    }


def static_bytes(s: Scenario, stage: int) -> float:
    """Held all step: memory.py's model states and device terms (context, workspaces,
    NCCL, allocator rounding), and DDP / ZeRO-1/2 bucket buffers."""
    br = stage_breakdown(s, stage)
    total = br.weights + br.gradients + br.optimizer + br.runtime
    if s.parallel.zero <= 2:
        total += br.comm_buffers
    return total


Hold = Callable[[int, Any, float, int, float], None]


def _zero3_holds(s: Scenario, m: Marks, hold: Hold) -> None:
    """ZeRO-3's gathered units, unsharded gradients and the root unit's."""
    par, defer = s.parallel, deferred(s)
    for (layer, mb), items in m.gathers.items():
        items.sort()  # creation order: the forward's gather, then the backward's
        parts = zero3_collectives(s.model, s.stack)
        for i, (_, t0) in enumerate(items):
            forward = t0 < m.fwd_end.get((layer, mb), t0) if defer else i < parts
            if forward and par.reshard_after_forward:
                t1 = m.fwd_end.get((layer, mb), t0)
            elif defer:  # resharded by the stage's reductions after its last backward
                t1 = m.unit_reduce.get(layer, t0)
            else:
                t1 = m.bwd_end.get((layer, mb), m.fwd_end.get((layer, mb), t0))
            hold(_UNIT, layer, t0, _START_ALLOC, t1)
    if defer:
        _accumulated(m, hold)
    ends: dict[tuple[int, int], float] = {}
    for tid, key in m.wgrad_ids.items():
        if tid in m.reduce_end and not defer:  # deferred: accumulated, then freed
            ends[key] = max(ends.get(key, 0.0), m.reduce_end[tid])
    for key, (t0, t1) in m.wgrad.items():
        hold(_GRAD, key, t0, _START_ALLOC, max(t1, ends.get(key, t1)))
    for (chunk, mb), t0 in m.root_gather.items():
        t1 = max((e for (c, _), e in m.root_reduce.items() if c == chunk), default=t0) \
            if defer else m.bwd_last.get((chunk, mb), t0)
        hold(_ROOT, chunk, t0, _START_ALLOC, t1)
    for (chunk, mb), t0 in m.root_grad.items():
        t1 = m.bwd_last.get((chunk, mb), t0)
        hold(_ROOT_GRAD, chunk, t0, _START_ALLOC, max(t1, m.root_reduce.get((chunk, mb), t1)))


def _accumulated(m: Marks, hold: Hold) -> None:
    """Under ``torch.distributed.pipelining`` (:mod:`simulator.strategies.zero3.deferred`)
    each unit's accumulated gradients, from its first weight gradients to its reduction
    after the stage's last backward; the root's from its chunk's first backward end."""
    first: dict[int, float] = {}
    for (layer, _), (_, end) in m.wgrad.items():
        first[layer] = min(first.get(layer, end), end)
    for layer, t0 in first.items():
        hold(_ACC, layer, t0, _END_ALLOC, max(t0, m.unit_reduce.get(layer, t0)))
    for (chunk, _), t1 in m.root_reduce.items():
        t0 = min((e for (c, _), e in m.bwd_last.items() if c == chunk), default=t1)
        hold(_ROOT_ACC, chunk, t0, _END_ALLOC, max(t0, t1))


def layer_components(s: Scenario, sizes: list[float], base: int) -> Callable[[int], int]:
    """The component of each layer's activations, one per distinct size (appended to
    ``sizes``, numbered from ``base``): memory.py's bytes of that layer (a dense or MoE
    layer, latent attention, context parallelism, its recompute policy)."""
    spec, par, trn = s.model, s.parallel, s.training
    ids: dict[float, int] = {}

    @functools.cache
    def component(layer: int) -> int:
        nbytes = mem.activation_bytes_per_layer(
            spec, trn.micro_batch, par.tp, par.sequence_parallel,
            layer_mode(par, spec.layers, layer), trn.dtype, layer, par.cp, s.stack,
            s.cp_keeps_gathered_kv, par.cp_a2a_degree > 1)
        if nbytes not in ids:
            ids[nbytes] = base + len(sizes)
            sizes.append(nbytes)
        return ids[nbytes]

    return component


def _rank_events(s: Scenario, spans: Iterable[tuple[Task, float, float]], tol: float,
                 act: Callable[[int], int]) -> list[tuple[float, int, int, Any, int]]:
    """(time, phase, component, key, +1/-1) for one rank's spans; ``act``: each layer's
    activation component (:func:`layer_components`)."""
    m = scan(spans)
    ev: list[tuple[float, int, int, Any, int]] = []

    def hold(comp: int, key: Any, t0: float, p0: int, t1: float) -> None:
        ev.append((t0, p0, comp, key, 1))
        ev.append((t1, _FREE, comp, key, -1))

    par, layers = s.parallel, s.model.layers
    for key, t0 in m.fwd_end.items():
        if keeps(par, layers, key[0]):  # not inside a group recomputed as one
            hold(act(key[0]), key, t0, _END_ALLOC, m.bwd_end.get(key, t0))
    for mb, t0 in m.embed_f.items():
        hold(_EMBED, mb, t0, _END_ALLOC, m.embed_b.get(mb, t0))
    for mb, t0 in m.head_f.items():
        hold(_HEAD, mb, t0, _END_ALLOC, m.head_b.get(mb, (t0, t0))[1])
    for mb, (t0, t1) in m.head_b.items():
        hold(_DLOGITS, mb, t0, _START_ALLOC, t1)
    for mb, (t0, t1) in m.metrics.items():
        hold(_METRICS, mb, t0, _START_ALLOC, t1)
    if s.parallel.zero == 3 and s.parallel.dp > 1:
        _zero3_holds(s, m, hold)
    # the engine adds durations along a run of compute tasks, so one task's end and the
    # next one's start may differ in the last bits: times within ``tol`` are one instant
    ev.sort(key=lambda e: e[0])
    instant = ev[0][0] if ev else 0.0
    for i, e in enumerate(ev):
        if e[0] - instant > tol:
            instant = e[0]
        ev[i] = (instant, *e[1:])
    ev.sort(key=lambda e: (e[0], e[1]))
    return ev


def _curve(static: float, sizes: Sequence[float], events: list[tuple[float, int, int, Any, int]],
           ) -> list[Point]:
    """Post-step points: each value holds from its time to the next point's."""
    counts = [0] * len(sizes)
    refs: dict[tuple[int, Any], int] = defaultdict(int)

    def value() -> float:
        return static + sum(c * b for c, b in zip(counts, sizes, strict=True))

    points: list[Point] = [[0.0, static]]

    def record(t: float) -> None:
        v = value()
        if v != points[-1][1]:
            points.append([t, v])

    i, n = 0, len(events)
    while i < n:
        t = events[i][0]
        for phase_end in (_END_ALLOC + 1, _START_ALLOC + 1):
            while i < n and events[i][0] == t and events[i][1] < phase_end:
                _, _, comp, key, d = events[i]
                ref = refs[comp, key]
                refs[comp, key] = ref + d
                if ref == 0 and d > 0:
                    counts[comp] += 1
                elif ref == 1 and d < 0:
                    counts[comp] -= 1
                i += 1
            record(t)
    return points


def memory_timeline(s: Scenario, result: SimResult, max_points: int = MAX_POINTS,
                    ranks: Iterable[int] | None = None, spans: pd.DataFrame | None = None,
                    ) -> Curve:
    """Each simulated rank's allocated bytes over the step, for results.json.

    A list, by rank, of ``{"rank": r, "stage": pipeline stage, "points": [[t, bytes],
    ...]}``: a step curve starting at ``[0, static bytes]``, a point only where the value
    changes, the value holding until the next point (or the end of the step), at most
    ``max_points`` points per rank (see :func:`downsample`). ``ranks`` limits the
    output to those simulated ranks (all of them by default). ``spans``, the run's span
    table (:mod:`simulator.outputs.span_table`) when it is built, gives the ranks' spans
    without a pass over every span of the run (ten million in a full-fidelity
    1,024-GPU step, for 16 curves).
    """
    tasks, layout = result.workload.tasks, result.workload.layout
    wanted = set(result.workload.programs) if ranks is None else \
        set(ranks) & set(result.workload.programs)
    per_rank: dict[int, list[tuple[Task, float, float]]] = defaultdict(list)
    if spans is None:
        for tid, start, end in result.spans:
            task = tasks[tid]
            per_rank[task.rank].append((task, start, end))
    else:
        rows = spans[spans["rank"].isin(sorted(wanted))]
        for tid, start, end in zip(rows["task"].tolist(), rows["start"].tolist(),
                                   rows["end"].tolist(), strict=True):
            task = tasks[tid]
            per_rank[task.rank].append((task, start, end))
    size = component_bytes(s)
    sizes = (size["embed"], size["head"], size["dlogits"], size["unit"], size["unit"])
    roots: dict[int, tuple[float, float]] = {}
    statics: dict[int, float] = {}
    extra: list[float] = []  # each layer's activations, by distinct size
    act = layer_components(s, extra, _ROOT_ACC + 1)
    rdt = s.stack.reduce_bytes(dtype_bytes(s.training.dtype)) / dtype_bytes(s.training.dtype)
    out: Curve = []
    for rank in sorted(wanted):
        stage = layout.coord(rank).pp
        if stage not in statics:
            statics[stage] = static_bytes(s, stage)
            roots[stage] = zero3_root_bytes(s, stage)
        events = _rank_events(s, per_rank.get(rank, []), TIME_TOL * result.end_time, act)
        points = _curve(statics[stage], (*sizes, *roots[stage], size["metrics"],
                                         size["accumulated"], roots[stage][0] * rdt, *extra),
                        events)
        out.append({"rank": rank, "stage": stage, "points": downsample(points, max_points)})
    return out


def peak(timeline: Any) -> float:
    """Largest value of a timeline: the list :func:`memory_timeline` returns, one of its
    entries, a ``{rank: points}`` mapping, or one ``[[t, bytes], ...]`` list."""
    if isinstance(timeline, Mapping):
        if "points" in timeline:
            return peak(timeline["points"])
        return max((peak(v) for v in timeline.values()), default=0.0)
    items = list(timeline)
    if not items:
        return 0.0
    if isinstance(items[0], Mapping) or (
            isinstance(items[0], Sequence) and items[0] and isinstance(items[0][0], Sequence)):
        return max(peak(item) for item in items)
    return max(float(v) for _, v in items)


def stage_peaks(timeline: Curve) -> dict[int, float]:
    """Largest value per pipeline stage, over the stage's simulated ranks."""
    out: dict[int, float] = {}
    for entry in timeline:
        st = int(entry["stage"])
        out[st] = max(out.get(st, 0.0), peak(entry["points"]))
    return out

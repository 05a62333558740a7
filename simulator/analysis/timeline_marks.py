"""What a rank's spans say about when each of its allocations starts and ends: the marks
:mod:`simulator.analysis.memory_timeline` turns into its curve.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from simulator.builder.tasks import Task


@dataclass
class Marks:
    """What one rank's spans say about when each allocation starts and ends, keyed by
    (layer, micro-batch), micro-batch or (chunk, micro-batch)."""

    fwd_end: dict[tuple[int, int], float] = field(default_factory=dict)
    bwd_end: dict[tuple[int, int], float] = field(default_factory=dict)
    embed_f: dict[int, float] = field(default_factory=dict)
    embed_b: dict[int, float] = field(default_factory=dict)
    head_f: dict[int, float] = field(default_factory=dict)
    head_b: dict[int, tuple[float, float]] = field(default_factory=dict)
    metrics: dict[int, tuple[float, float]] = field(default_factory=dict)  # the trainer's
    wgrad: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # [start, end]
    # task producing a layer's weight grads
    wgrad_ids: dict[int, tuple[int, int]] = field(default_factory=dict)
    gathers: dict[tuple[int, int], list[tuple[int, float]]] = field(
        default_factory=lambda: defaultdict(list))
    # producing task id -> end of the RS that waits on it
    reduce_end: dict[int, float] = field(default_factory=dict)
    root_gather: dict[tuple[int, int], float] = field(default_factory=dict)  # gather start
    root_grad: dict[tuple[int, int], float] = field(default_factory=dict)  # head's bwd start
    root_reduce: dict[tuple[int, int], float] = field(default_factory=dict)  # root's RS end
    bwd_last: dict[tuple[int, int], float] = field(default_factory=dict)  # chunk's bwd end
    unit_reduce: dict[int, float] = field(default_factory=dict)  # a deferred unit's RS end


def passes(m: Marks, t: Task, start: float, end: float) -> None:
    """A compute span's marks: forward and backward ends, the model's ends."""
    op, layer, mb = t.op, t.layer, t.microbatch
    if op in ("B", "I", "W"):
        key = (t.chunk, mb)
        m.bwd_last[key] = max(m.bwd_last.get(key, end), end)
        if layer < 0 and op != "I" and t.name.startswith("head"):
            # the output layer's gradient: at B's end (the loss's copies freed), or as W starts
            m.root_grad[t.chunk, mb] = end if op == "B" else start
    if op == "F":
        if layer >= 0:
            m.fwd_end[layer, mb] = max(m.fwd_end.get((layer, mb), end), end)
        elif t.name.startswith("embed"):
            m.embed_f[mb] = end
        elif t.name.startswith("head"):
            m.head_f[mb] = end
        elif t.name.startswith("metrics"):
            m.metrics[mb] = (start, end)
    elif op in ("B", "I"):
        if layer >= 0:
            m.bwd_end[layer, mb] = max(m.bwd_end.get((layer, mb), end), end)
        elif t.name.startswith("head"):
            m.head_b[mb] = (start, end)
        elif t.name.startswith("embed"):
            m.embed_b[mb] = end


def scan(spans: Iterable[tuple[Task, float, float]]) -> Marks:
    m = Marks()
    for t, start, end in spans:
        op, layer, mb = t.op, t.layer, t.microbatch
        passes(m, t, start, end)
        if op in ("B", "W") and layer >= 0:
            w = m.wgrad.setdefault((layer, mb), [start, end])
            w[0], w[1] = min(w[0], start), max(w[1], end)
            m.wgrad_ids[t.id] = (layer, mb)
        elif op == "zero.all_gather" and layer < 0:
            m.root_gather[t.chunk, mb] = start
        elif op == "zero.all_gather":
            m.gathers[layer, mb].append((t.id, start))
        elif t.kind == "dp" and op.endswith("reduce_scatter") and " root " in t.name:
            m.root_reduce[t.chunk, mb] = end
        elif t.kind == "dp" and op.endswith("reduce_scatter") and layer >= 0:
            m.unit_reduce[layer] = max(m.unit_reduce.get(layer, end), end)  # deferred
        elif t.kind == "dp" and op.endswith("reduce_scatter"):
            for d in t.deps:
                m.reduce_end[d] = max(m.reduce_end.get(d, end), end)
    return m

"""TP communication overlap: which GEMM each sequence-parallel collective of a block
meets, and what the overlap leaves exposed.

Megatron-Core's ``--tp-comm-overlap`` runs a block's all-gather and reduce-scatter
through Transformer Engine's userbuffers beside the projection next to each, with
TE's default methods (transformer_engine/pytorch/module/base.py, ``initialize_ub``):
``ring_exchange`` for qkv_fprop, fc1_fprop, proj_dgrad and fc2_dgrad, ``pipeline`` for
proj_fprop and fc2_fprop, ``bulk`` for the qkv and fc1 dgrad/wgrad pairs. The stack
field ``tp_overlap`` says how much of that runs:

- ``bulk`` (``--tp-comm-overlap`` with ``--disable-tp-comm-overlap-ag`` and
  ``--disable-tp-comm-overlap-rs``): only the backward's reduce-scatter of the first
  projection's input gradient (QKV, MLP up), beside that projection's weight-gradient
  GEMM;
- ``pipelined`` (TE's defaults): besides, the forward's all-gather as a ring exchange
  with the first projection in tp row chunks (a chunk's GEMM runs on the shard that has
  arrived, the last after the ring), the forward's reduce-scatter pipelined with the last
  projection (out-proj, MLP down) in tp chunks (the first chunk before the
  reduce-scatter starts), and the backward's all-gather of the output gradient as a
  ring exchange with that projection's input-gradient GEMM in chunks.

Per side, with the collective taking t and its GEMM ``whole`` seconds, or ``parts``
chunks of ``chunk`` seconds each (:func:`gemm_chunk`: 1/parts of the rows, so the
split costs what smaller GEMMs lose):

  ring exchange:  max(t, (p − 1)·c) + c          (the compute stream waits for t)
  pipeline:       c + max(t, (p − 1)·c)
  bulk:           max(t, W)

which is what the engine's pieces produce (:mod:`simulator.strategies.tensor.workload`) and what
:func:`exposed` gives the analytic method. The GEMMs run at full speed beside the
transfer unless the profile has an interference factor (the engine applies it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from simulator.model import transformer as mdl
from simulator.model.inventory.ops import Op, Pass

if TYPE_CHECKING:
    from simulator.spec.scenario import Scenario
    from simulator.system.costs import CostModel

#: the projection at each end of a block (the inventory's op names)
FIRST_GEMM = {"attn": "qkv", "mlp": "mlp_up"}
LAST_GEMM = {"attn": "out_proj", "mlp": "mlp_down"}

#: (block label, "ag" before the block or "rs" after it, backward) -> its GEMM
Windows = Mapping[tuple[str, str, bool], "Window"]


@dataclass(frozen=True)
class Window:
    """The GEMM a TP collective overlaps: its op, its seconds as the block's task holds
    it, and, split into ``parts`` chunks (1: not split), the seconds of one chunk."""

    gemm: str
    whole: float
    chunk: float
    parts: int

    @property
    def hidden(self) -> float:
        """Compute seconds beside the transfer: all chunks but one, or the whole GEMM."""
        return (self.parts - 1) * self.chunk if self.parts > 1 else self.whole

    @property
    def extra(self) -> float:
        """What splitting adds to the GEMM's seconds."""
        return self.parts * self.chunk - self.whole if self.parts > 1 else 0.0


def gemm_chunk(op: Op, parts: int) -> Op:
    """One of ``parts`` row chunks of GEMM ``op``: 1/parts of its FLOPs on the efficiency
    curve of a call that size (its shape's rows split), and of its bytes."""
    return replace(op, flops=op.flops / parts, bytes=op.bytes / parts,
                   gemm_flops=op.gemm_flops / parts, saved=0.0,
                   gemm_call=op.gemm_call and op.gemm_call.rows(parts))


def overlap_sides(mode: str, backward: bool) -> tuple[bool, bool]:
    """Under ``stack.tp_overlap`` = ``mode``: whether a block's all-gather (before it)
    and its reduce-scatter (after it) overlap a GEMM, in forward or backward."""
    if mode == "pipelined":
        return True, True
    return False, mode == "bulk" and backward


def active(s: Scenario) -> bool:
    """Whether the scenario overlaps TP collectives at all (sequence parallelism, tp > 1,
    a device that overlaps communication)."""
    par = s.parallel
    return (s.stack.tp_overlap != "none" and par.tp > 1 and par.sequence_parallel
            and s.hardware.gpu.comm_overlaps_compute)


def overlap_windows(s: Scenario, cost: CostModel) -> dict[tuple[str, str, bool], Window]:
    """Every block's overlapped GEMMs on one TP rank, priced by ``cost``; empty when the
    scenario does not overlap (:func:`active`)."""
    if not active(s):
        return {}
    tp = s.parallel.tp

    def ops(pass_: Pass) -> dict[str, Op]:
        return {op.name: op for op in mdl.layer_ops(s.model, s.training.micro_batch, tp, True,
                                                    s.training.dtype, pass_, 0, s.stack)}

    fwd, dgrad, wgrad = ops("fwd"), ops("bwd_input"), ops("bwd_weight")

    def split(op: Op) -> Window:
        return Window(op.name, cost.op_time(op), cost.op_time(gemm_chunk(op, tp)), tp)

    out = {}
    for label in ("attn", "mlp"):
        first, last = FIRST_GEMM[label], LAST_GEMM[label]
        out[label, "ag", False] = split(fwd[first])  # ring exchange
        out[label, "rs", False] = split(fwd[last])  # pipelined split
        out[label, "ag", True] = split(dgrad[last])  # ring exchange
        w = cost.op_time(wgrad[first])  # bulk: beside the whole weight-gradient GEMM
        out[label, "rs", True] = Window(first, w, w, 1)
    return out


def exposed(mode: str, windows: Windows, t_comm: float, backward: bool,
            weights: bool = True, issue: float = 0.0,
            labels: tuple[str, ...] = ("attn", "mlp")) -> tuple[float, float]:
    """One layer's TP seconds in one pass under overlap ``mode``, as (exposed transfer,
    compute the split GEMMs add), for sequence parallelism's all-gather and
    reduce-scatter of ``t_comm`` each around the blocks ``labels`` (both, or those a
    recomputation re-runs); ``weights``: whether the backward computes weight gradients
    (an I action does not); ``issue``: of ``t_comm``, the host time of issuing it, which
    no GEMM hides."""
    comm = extra = 0.0
    ag, rs = overlap_sides(mode, backward)
    rs = rs and (weights or not backward)
    for label in labels:
        for side, on in (("ag", ag), ("rs", rs)):
            if not on:
                comm += t_comm
                continue
            w = windows[label, side, backward]
            comm += issue + max(t_comm - issue - w.hidden, 0.0)
            extra += w.extra
    return comm, extra

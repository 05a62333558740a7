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
  projection (out-proj, MLP down) in 4 chunks (the first chunk before the
  reduce-scatter starts), and the backward's all-gather of the output gradient as a
  ring exchange with that projection's input-gradient GEMM in tp chunks.

Per side, with the collective taking t and its GEMM ``whole`` seconds, or ``parts``
chunks of ``chunk`` seconds each (:func:`gemm_chunk`: 1/parts of the rows, so the
split costs what smaller GEMMs lose), m the SM margin's slowdown (1 for a ring
exchange; below):

  ring exchange:  max(t, (p − 1)·c) + c          (the compute stream waits for t)
  pipeline:       m·c + max((p − 1)·t/p, m·(p − 1)·c) + t/p
  bulk:           max(t, m·W), and (m − 1) times the input-gradient GEMM beside it

A pipeline reduce-scatters each chunk once its GEMM is done
(``CommOverlapBase::split_overlap_rs``): the first chunk's GEMM runs before any
transfer and the last chunk's reduce-scatter after the last GEMM (with all SMs,
``UB_MAX_SM``), the window's ``tail`` of the transfer (1/p); the engine issues that
part as a collective of its own in line, the closed form adds t/p.

which is what the engine's pieces produce (:mod:`simulator.strategies.tensor.workload`) and what
:func:`exposed` gives the analytic method.

Without userbuffers Megatron still overlaps the column-parallel projections' backward
(``async``, the megatron-2022 and megatron-core stacks): their input gradient's
all-reduce (reduce-scatter under sequence parallelism) is issued asynchronously before
the weight-gradient GEMM and waited for after it (Megatron-LM
``LinearWithGradAccumulationAndAsyncCommunication.backward``, megatron/mpu/layers.py
from 2021-09, ``--no-async-tensor-model-parallel-allreduce`` to turn the all-reduce off;
Transformer Engine ``_LayerNormLinear.backward`` and ``_Linear.backward``:
``reduce_scatter_along_first_dim`` or ``allreduce`` with ``async_op=True``). It is
NCCL's own collective, holding its channels' SMs while it runs
(:mod:`simulator.system.collectives.channels`): the bulk closed form max(t, W) with no
margin; the forward's collectives and the row-parallel projections' stay in line. Not
modelled beside MoE layers or context parallelism, whose blocks keep theirs in line.

Under sequence parallelism both frameworks also all-gather the saved input shard again
in the backward, beside the input-gradient GEMM (the async ``gather_along_first_dim``;
TE's ``ub_bulk_dgrad`` under userbuffers), for the weight gradient: that transfer is not
among the modelled collectives in any mode.

How TE runs each method, from its defaults (``initialize_ub``'s ``get_default_config``,
v1.9 through v2.x; the C++ side in ``transformer_engine/common/comm_gemm_overlap/
comm_gemm_overlap.cpp``):

- ``ring_exchange``: ``num_splits`` = tp (a chunk per ring step) and ``use_ce`` true:
  the chunks move by copy engine (``userbuffers_send`` with ``use_ce``), so no SM is
  taken from the GEMMs;
- ``pipeline``: ``num_splits`` 4 (:data:`PIPELINE_SPLITS`), whatever tp is, and
  ``num_sm`` 16 (:data:`COMM_SMS`) for the userbuffers reduce-scatter kernels;
- ``bulk``: ``num_sm`` 16 as well.

From TE v2.0, ``set_sm_margin`` is true for ``pipeline`` and ``bulk``
(``not method == "ring_exchange"``): their GEMMs run on ``sm_count − num_comm_sm``
SMs (``_math_sms`` in ``CommOverlapCore``, passed to every chunk's cuBLAS call), so
they take gpu.sms / (gpu.sms − 16) times as long, the whole GEMM (:func:`margin`;
before v2.0 the same SMs went to the communication kernel while it ran). The bulk
method pairs the first projection's input-gradient GEMM with an all-gather of its input
too (``qkv_dgrad``, ``fc1_dgrad``; not among the modelled collectives), on the same
margin: that GEMM's slowdown is the window's ``aside``. These collectives' plans hold
no SMs of their own (``Plan.sms`` 0): what they take is the margin.

Under PyTorch's symmetric memory (``stack.tp_overlap_runtime: symmetric_memory``,
torchtitan's async TP: ``torch/distributed/_symmetric_memory/__init__.py``
``_pipelined_all_gather_and_consume`` and ``_pipelined_produce_and_all2all``) every
transfer is a chunk per rank moved by copy engines: no margin, nothing of the transfer
after the GEMMs. Its reduce-scatter ends with the sum of the partial chunks the rank
received (``reduce_fn`` over ``stacked_partials``: the block's output read, the shard
written, :func:`partials_sum`, the window's ``after``), and in the backward it is the
input-gradient GEMM's (torch.compile's micro-pipeline TP pass matches matmul then
reduce-scatter in the backward graph too), in tp chunks, not the weight gradient's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from simulator.model import transformer as mdl
from simulator.model.inventory.ops import Op, Pass, dtype_bytes, mem

if TYPE_CHECKING:
    from simulator.spec.scenario import Scenario
    from simulator.system.costs import CostModel

#: TE's userbuffers: the SMs a ``pipeline`` or ``bulk`` overlap's communication kernels
#: take (``get_default_config``: ``num_sm`` 16 but for ``ring_exchange``), and the chunks
#: a ``pipeline`` overlap splits its GEMM into (``num_splits`` 4)
COMM_SMS = 16
PIPELINE_SPLITS = 4

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
    #: how many times longer its GEMM runs on the SMs TE's margin leaves (:func:`margin`)
    slow: float = 1.0
    #: seconds the margin adds to another GEMM of the same overlap (the bulk method's
    #: input-gradient GEMM, beside its all-gather)
    aside: float = 0.0
    #: of the transfer, the share left after the last GEMM (a pipeline's last chunk)
    tail: float = 0.0
    #: the seconds of the transfer beside the GEMMs and of its tail, as shares of the
    #: whole transfer's (:func:`price_tails`; unpriced: its bytes' shares)
    priced: tuple[float, float] | None = None
    #: whether its GEMM is a weight-gradient GEMM (TE's bulk method): an I action of a
    #: zero-bubble schedule has none, so its reduce-scatter stays in line
    weight: bool = False
    #: compute seconds after the transfer (symmetric memory's sum of the partials)
    after: float = 0.0

    @property
    def shares(self) -> tuple[float, float]:
        """(beside the GEMMs, after them): the transfer's seconds as shares of the whole's."""
        return self.priced or (1.0 - self.tail, self.tail)

    @property
    def hidden(self) -> float:
        """Compute seconds beside the transfer: all chunks but one, or the whole GEMM."""
        return ((self.parts - 1) * self.chunk if self.parts > 1 else self.whole) * self.slow

    @property
    def first(self) -> float:
        """Compute seconds of the chunk not beside the transfer (a pipeline's first, before
        it starts; a ring exchange's last, after it), else none."""
        return self.chunk * self.slow if self.parts > 1 else 0.0

    @property
    def extra(self) -> float:
        """What splitting, the SM margin and the kernels after the transfer add to the
        overlap's GEMM seconds."""
        return self.first + self.hidden - self.whole + self.aside + self.after


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
    return False, mode in ("bulk", "async") and backward


def active(s: Scenario) -> bool:
    """Whether the scenario overlaps TP collectives at all (tp > 1, a device that
    overlaps communication; sequence parallelism for TE's userbuffers, dense layers
    without context parallelism for Megatron's ``async`` backward)."""
    par, mode = s.parallel, s.stack.tp_overlap
    if mode == "none" or par.tp == 1 or not s.hardware.gpu.comm_overlaps_compute:
        return False
    if mode == "async":
        return not s.model.is_moe and par.cp == 1
    return par.sequence_parallel


def backward_resyncs(s: Scenario) -> bool:
    """Whether each backward block holds a TP collective on the compute stream, which
    every TP rank leaves together (asymmetric folding relies on it,
    :func:`simulator.spec.variability.odd_tp_indices`): yes in line, under ``bulk`` (the
    output gradient's all-gather) and under ``async`` with sequence parallelism (the
    same); no under ``async`` without it (its all-reduce beside the weight-gradient GEMM
    is the block's only one) nor under ``pipelined`` (ring exchange and bulk, both beside
    the GEMMs). A side collective ends together on every rank, the compute beside it
    does not."""
    if not active(s):
        return True
    mode = s.stack.tp_overlap
    return mode == "bulk" or (mode == "async" and s.parallel.sequence_parallel)


def userbuffers(s: Scenario) -> bool:
    """Whether Transformer Engine's userbuffers run the overlap (``stack.tp_overlap_runtime``);
    PyTorch's symmetric memory moves a chunk per rank by copy engines: no SM margin, no
    pipeline of 4, no tail."""
    return s.stack.tp_overlap_runtime == "userbuffers"


def margin(s: Scenario) -> float:
    """How many times longer a GEMM takes on the SMs TE's ``set_sm_margin`` leaves it,
    gpu.sms / (gpu.sms − :data:`COMM_SMS`); 1 on a profile without an SM count and
    without userbuffers."""
    sms = s.hardware.gpu.sms
    return sms / (sms - COMM_SMS) if userbuffers(s) and sms and sms > COMM_SMS else 1.0


def overlap_windows(s: Scenario, cost: CostModel) -> dict[tuple[str, str, bool], Window]:
    """Every block's overlapped GEMMs on one TP rank, priced by ``cost``; empty when the
    scenario does not overlap (:func:`active`)."""
    if not active(s):
        return {}
    asynchronous = s.stack.tp_overlap == "async"  # NCCL's own, no TE margin, backward only
    tp, slow = s.parallel.tp, 1.0 if asynchronous else margin(s)
    splits, tail = (PIPELINE_SPLITS, 1 / PIPELINE_SPLITS) if userbuffers(s) else (tp, 0.0)

    def ops(pass_: Pass) -> dict[str, Op]:
        return {op.name: op for op in mdl.layer_ops(s.model, s.training.micro_batch, tp, True,
                                                    s.training.dtype, pass_, 0, s.stack)}

    fwd, dgrad, wgrad = ops("fwd"), ops("bwd_input"), ops("bwd_weight")

    def bulk(first: str) -> Window:
        """The first projection's input-gradient collective beside its whole
        weight-gradient GEMM (TE's bulk method, or Megatron's async backward)."""
        w = cost.op_time(wgrad[first])
        return Window(first, w, w, 1, slow, cost.op_time(dgrad[first]) * (slow - 1),
                      weight=True)

    if asynchronous:
        return {(label, "rs", True): bulk(FIRST_GEMM[label]) for label in ("attn", "mlp")}

    def split(op: Op, parts: int, factor: float = 1.0, tail: float = 0.0,
              after: float = 0.0) -> Window:
        return Window(op.name, cost.op_time(op), cost.op_time(gemm_chunk(op, parts)), parts,
                      factor, tail=tail, after=after)

    out = {}
    for label in ("attn", "mlp"):
        first, last = FIRST_GEMM[label], LAST_GEMM[label]
        out[label, "ag", False] = split(fwd[first], tp)  # ring exchange, copy engines
        out[label, "ag", True] = split(dgrad[last], tp)  # ring exchange, copy engines
        if not userbuffers(s):  # a chunk per rank, then the sum of the received partials
            reduce = cost.op_time(partials_sum(s))
            out[label, "rs", False] = split(fwd[last], tp, after=reduce)
            out[label, "rs", True] = split(dgrad[first], tp, after=reduce)
            continue
        out[label, "rs", False] = split(fwd[last], splits, slow, tail)  # pipeline
        out[label, "rs", True] = bulk(first)
    return out


def partials_sum(s: Scenario) -> Op:
    """Symmetric memory's end of a reduce-scatter (``_fused_matmul_reduce_scatter_impl``:
    ``reduce_fn`` over the stacked partials): the tp partial chunks of the rank's shard,
    the block's whole output, read, and the shard written, one kernel."""
    tp, dt = s.parallel.tp, dtype_bytes(s.training.dtype)
    nbytes = mdl.tp_comm_bytes_per_layer(s.model, s.training.micro_batch, s.training.dtype)
    return mem("tp_partials_sum", nbytes / dt / tp, dt * (tp + 1), "reduction")


def price_tails(windows: Windows, seconds: Callable[[float], float]
                ) -> dict[tuple[str, str, bool], Window]:
    """``windows`` with each tail's split priced: ``seconds(share)``, the seconds of a
    transfer of that share of a block's bytes (its own latency each, as the engine runs
    the two collectives)."""
    whole = seconds(1.0)
    return {k: replace(w, priced=(seconds(1.0 - w.tail) / whole, seconds(w.tail) / whole))
            if w.tail and whole > 0 else w for k, w in windows.items()}


def exposed(mode: str, windows: Windows, t_comm: float, backward: bool,
            weights: bool = True, issue: float = 0.0,
            labels: tuple[str, ...] = ("attn", "mlp"), sp: bool = True
            ) -> tuple[float, float]:
    """One layer's TP seconds in one pass under overlap ``mode``, as (exposed transfer,
    compute the split GEMMs add), for sequence parallelism's all-gather and
    reduce-scatter of ``t_comm`` each around the blocks ``labels`` (both, or those a
    recomputation re-runs); ``weights``: whether the backward computes weight gradients
    (an I action does not); ``issue``: of ``t_comm``, the host time of issuing it, which
    no GEMM hides; ``sp``: without sequence parallelism (Megatron's ``async`` backward)
    a block has no collective before it, only the all-reduce after it."""
    comm = extra = 0.0
    ag, rs = overlap_sides(mode, backward)
    sides = (("ag", ag), ("rs", rs)) if sp else (("rs", rs),)
    for label in labels:
        for side, on in sides:
            w = windows[label, side, backward] if on else None
            if w is None or (w.weight and not weights):
                comm += t_comm
                continue
            beside, after = w.shares  # of the transfer after its host issue
            comm += issue + max((t_comm - issue) * beside - w.hidden, 0.0) \
                + (t_comm - issue) * after
            extra += w.extra
    return comm, extra

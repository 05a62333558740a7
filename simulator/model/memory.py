"""Per-rank memory: model states under ZeRO, activations under a schedule, buffers.

One :class:`MemoryBreakdown` per pipeline stage (every TP and DP rank of a
stage holds the same amounts). 1 GB = 1e9 bytes throughout.

Model states follow the ZeRO paper's table for mixed-precision AdamW: 2 bytes of 16-bit
weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master weights, momentum,
variance) per parameter (fewer with the stack's lower-precision master weights or moments:
:meth:`simulator.spec.stack.StackSpec.optimizer_bytes`), sharded over N_d = dp by ZeRO stage
(1: optimizer, 2: + gradients, 3: + weights). fp32 training keeps 4 + 4 + 8 (the weights are
the master copy), and so does 16-bit training whose fp32 parameters are the master
(autocast; FSDP's mixed precision, ``stack.master_weights``).
Parameters are the stage's layers (:mod:`simulator.spec.placement`: an even split, or
``parallel.layers_per_stage``) plus the embedding on the first stage and the final
norm and output projection on the last; a tied output projection has its own copy on
the last stage when pp > 1, as Megatron keeps it. A stage's parameters divide by tp (norms and
biases replicated across TP ranks, < 0.1 %, are ignored).

Activations follow Korthikanti et al. 2022 (Table 2, 16-bit, dropout masks
included, attention scores stored unless recomputed), generalised to GQA and
SwiGLU so that a GPT block gives the table exactly; they are multiplied by the
layers a stage holds (all its chunks; an uneven interleaved split counts the
stage's total, an approximation when its chunks differ) and the schedule's
in-flight micro-batches (its entry in :data:`simulator.schedules.registry.SCHEDULES`). Full
recomputation keeps each layer's input (sharded with sequence parallelism).
The last stage also holds fp32 logits: the saved softmax of every micro-batch
whose backward has not run yet, plus one more copy for the loss gradient (under
flash-attn's fused loss the 16-bit logits and a 16-bit gradient: :func:`logits`).

Communication buffers: DDP / ZeRO-1/2 hold two gradient buckets in flight;
ZeRO-3 holds gathered 16-bit parameters, unsharded gradients and the stage's root unit
(FSDP2's ``fully_shard`` on the stage's module: embedding, final norm, output layer),
not all at once: the table takes the moment of the backward that holds the most, the
loss's (every logits copy, the root and the running unit gathered) or the first
block's (the loss's copies of the running micro-batch freed, :func:`logits_after_head`;
the running and prefetched units, a layer's and the output layer's unsharded
gradients): :mod:`simulator.strategies.zero3.buffers`.
ZeRO-Offload moves the
optimizer states (and with ZeRO-2/3 the gradient shards) to host memory.

Beside the tensors, ``device`` holds what the process keeps on the GPU regardless of
them, by named term (:mod:`simulator.model.device_memory`: the CUDA context, cuBLAS
workspaces, NCCL's buffers per communicator, the caching allocator's rounding).

Gradient compression (:func:`simulator.strategies.compression.memory_extra`) adds PowerSGD's
error-feedback buffer, P, Q and bucket copies (the DDP hook's state) and the cast
buckets of bf16/fp8 to the communication buffers, and 1-bit Adam's worker and
server error buffers (OnebitAdam's state) to the optimizer states.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.model import moe
from simulator.model.inventory.attention import cp_a2a_bytes, cp_kv_bytes
from simulator.model.inventory.layer import kept_for_backward, latent_kept
from simulator.model.inventory.loss import metric_bytes
from simulator.model.inventory.mtp import mtp_kept
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.transformer import (
    RecomputeMode,
    embedding_params,
    head_params,
    layer_params,
)
from simulator.schedules.registry import schedule_spec
from simulator.spec.model_spec import ModelSpec
from simulator.spec.placement import holds_embedding, holds_head
from simulator.spec.recompute import kept_runs, stage_modes
from simulator.spec.scenario import Scenario
from simulator.spec.stack import StackSpec, default_stack

ADAMW_K = 12  # fp32 master weights + momentum + variance, bytes per parameter


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of pipeline ``stage``."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    comm_buffers: float
    capacity: float  # GPU HBM, 1e9 × memory_GB
    # memory beside the tensors, by named term (simulator.model.device_memory.DEVICE_TERMS)
    device: tuple[tuple[str, float], ...] = ()
    # the moment of the step it is: "" the backward's peak, "metrics" after a backward
    # while the trainer's metrics run (simulator.analysis.memory.after_backward)
    moment: str = ""

    @property
    def runtime(self) -> float:
        """The device terms together: context, workspaces, NCCL, allocator rounding."""
        return sum(nbytes for _, nbytes in self.device)

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.logits + self.comm_buffers + self.runtime)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


# ---------------------------------------------------------------- model states


def state_bytes_per_param(zero: int, n_d: int, dtype: str = "bf16", grad_bytes: int | None = None,
                          fp32_params: bool = False, optimizer_bytes: float | None = None
                          ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter on one rank; ``grad_bytes``
    overrides the gradients' width (4 where the stack keeps fp32 main grads);
    ``fp32_params``: the parameters are fp32 and are the master copy (autocast, FSDP's
    mixed precision: :meth:`simulator.spec.stack.StackSpec.fp32_params`);
    ``optimizer_bytes`` overrides the optimizer state's (the stack's master-weight and
    moment dtypes: :meth:`simulator.spec.stack.StackSpec.optimizer_bytes`)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {zero}")
    if n_d < 1:
        raise ValueError(f"data-parallel degree must be >= 1; got {n_d}")
    if dtype_bytes(dtype) == 4 or fp32_params:
        weights, grads, optimizer = 4.0, 4.0, 8.0  # fp32: master weights are the weights
    else:
        weights, grads, optimizer = 2.0, 2.0, float(ADAMW_K)
    if grad_bytes is not None:
        grads = float(grad_bytes)
    if optimizer_bytes is not None:
        optimizer = float(optimizer_bytes)
    return (weights / n_d if zero >= 3 else weights,
            grads / n_d if zero >= 2 else grads,
            optimizer / n_d if zero >= 1 else optimizer)


def zero_memory_bytes(psi: float, zero: int, n_d: int, dtype: str = "bf16") -> float:
    """Model-state bytes per GPU for Ψ parameters (ZeRO paper, Fig. 1; docs/model.md)."""
    return psi * sum(state_bytes_per_param(zero, n_d, dtype))


# ---------------------------------------------------------------- activations


@functools.lru_cache(maxsize=4096)  # a plan's candidates share a few hundred layers
def activation_bytes_per_layer(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    recompute: RecomputeMode = "none", dtype: str = "bf16", layer: int = 0, cp: int = 1,
    stack: StackSpec | None = None, cp_kv_kept: bool = False, cp_a2a: bool = False,
) -> float:
    """Stored activations of one layer on one TP rank.

    A dense layer keeps what its forward ops save in the op inventory
    (:func:`simulator.model.inventory.layer.kept_for_backward`), so compute and memory describe
    one program: under an unfused-attention stack with dropout (Megatron-LM 2021/2022)
    that is Korthikanti et al. 2022, Table 2 exactly, s·b·h·(34 + 5as/h) for GPT at
    t = 1 (the s×s scores, softmax and its dropout 5·a·s²·b, dropped by selective
    recomputation); a flash-attention stack keeps no s×s matrix, and a stack without
    dropout no masks. Context parallelism keeps s/cp tokens per rank with a fused
    attention core; with ``cp_kv_kept`` (the all-gather variant under a stack that
    keeps the gathered keys and values,
    :attr:`simulator.spec.scenario.Scenario.cp_keeps_gathered_kv`)
    its core holds every rank's keys and values, cp − 1 chunks more, unless the layer
    is recomputed in full; with ``cp_a2a`` (the all-to-all variants) the core keeps its
    output before the all-to-all that returns it (Transformer Engine's
    ``AttnFuncWithCPAndQKVOA2A`` saves ``out_part``, the layer's next linear the
    exchanged copy): one attention output more, unless the core is recomputed. A
    mixture of experts' layers are the inventory's too
    (:func:`simulator.model.inventory.experts.moe_layer_ops`); a latent-attention model's
    layers keep what their coarser ops save (:func:`simulator.model.moe.kept_bytes`: their
    own widths and a flash core, the same under selective recomputation, which a flash
    core leaves nothing to drop from).
    """
    st = stack or default_stack()
    extra = 0.0  # what the CP variant's core keeps besides the local chunk's
    if cp > 1:  # the local chunk (cp divides the sequence), with the fused core CP runs
        spec = spec.model_copy(update={"seq_len": spec.seq_len // cp})
        st = st.model_copy(update={"attention": "flash2"}) if not st.flash else st
        if cp_kv_kept and recompute != "full":
            extra = (cp - 1) * cp_kv_bytes(spec, micro_batch, tp, dtype)
        if cp_a2a and recompute == "none":
            extra = cp_a2a_bytes(spec, micro_batch, tp, dtype)[0]
    return extra + _kept_per_layer(spec, micro_batch, tp, sequence_parallel, recompute,
                                      dtype, layer, st)


def _kept_per_layer(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                    recompute: RecomputeMode, dtype: str, layer: int, st: StackSpec) -> float:
    if spec.mla is None:
        return kept_for_backward(spec, micro_batch, tp, sequence_parallel, dtype, recompute, st,
                                 layer)
    if recompute == "full":  # the layer's input
        replicated = 1 / tp if sequence_parallel else 1.0
        return 2.0 * spec.seq_len * micro_batch * spec.hidden * replicated \
            * dtype_bytes(dtype) / 2
    if recompute in ("none", "selective"):
        return sum(op.saved for op in moe.layer_ops(spec, micro_batch, tp, sequence_parallel,
                                                    dtype, "fwd", layer, stack=st))
    return sum(latent_kept(spec, micro_batch, tp, sequence_parallel, dtype, recompute, st, layer))


def in_flight_microbatches(schedule: str, p: int, m: int, v: int, stage: int) -> float:
    """Peak micro-batches whose activations ``stage`` holds, in full-stage units: the
    schedule registry's (:data:`simulator.schedules.registry.SCHEDULES`), e.g. m for GPipe,
    min(p - stage, m) for 1F1B and ZB-H1."""
    spec = schedule_spec(schedule)
    if min(p, m, v) < 1 or not 0 <= stage < p:
        raise ValueError(f"need p, m, v >= 1 and 0 <= stage < p; got p={p}, m={m}, v={v}, "
                         f"stage={stage}")
    return spec.in_flight(p, m, v, stage)


# ---------------------------------------------------------------- per stage


Runs = Sequence[range]  # the layer runs of one stage (simulator.spec.placement.stage_layers)


def _runs(spec: ModelSpec, pp: int, stage: int, runs: Runs | None) -> Runs:
    """``runs`` when given, else the even split's run of ``stage``."""
    if runs is not None:
        return runs
    per = spec.layers // pp
    return [range(stage * per, (stage + 1) * per)]


def _kinds(spec: ModelSpec, runs: Runs) -> list[tuple[int, int]]:
    """(representative layer, how many layers like it) over the runs, in closed form."""
    return [kind for r in runs for kind in moe.run_kinds(spec, r)]


def stage_expert_params(spec: ModelSpec, pp: int, stage: int, runs: Runs | None = None) -> int:
    """The routed experts' parameters of ``stage`` (what expert parallelism splits);
    ``runs`` are its layers (default the even split)."""
    return sum(n * moe.expert_params(spec, i) for i, n in _kinds(spec, _runs(spec, pp, stage,
                                                                            runs)))


def stage_params(spec: ModelSpec, pp: int, stage: int, runs: Runs | None = None,
                 head_rank: int | None = None, ends: tuple[bool, bool] | None = None) -> int:
    """Parameters held by pipeline ``stage`` (before the TP and EP splits); ``runs`` are
    its layers (default the even split); ``head_rank`` the stage with the output layer
    (default pp − 1; 0 under a V placement, :func:`simulator.spec.placement.head_rank`);
    ``ends`` whether the stage holds the embedding and the output layer where that is not
    stage 0 and ``head_rank`` alone (DualPipe: :func:`simulator.spec.placement.holds_head`)."""
    head_at = pp - 1 if head_rank is None else head_rank
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside 0..{pp - 1}")
    runs = _runs(spec, pp, stage, runs)
    if spec.is_moe or spec.mla is not None:
        total = sum(n * layer_params(spec, i) for i, n in _kinds(spec, runs))
    else:
        total = sum(len(r) for r in runs) * layer_params(spec)
    embedding, head = (stage == 0, stage == head_at) if ends is None else ends
    if embedding:
        total += embedding_params(spec)
    if head:
        total += head_params(spec)
        if spec.head_needs_embedding and not embedding:  # the output layer's rank lacks it:
            total += spec.vocab * spec.hidden  # Megatron's copy of the shared embedding
    return total


def activations(scenario: Scenario, stage: int) -> float:
    spec, par, trn = scenario.model, scenario.parallel, scenario.training
    b, t, sp = trn.micro_batch, par.tp, par.sequence_parallel
    in_flight = in_flight_microbatches(par.schedule, par.pp, scenario.microbatches,
                                       par.virtual_stages, stage)
    total = 0.0
    # one group unless partial
    for mode, chunks in stage_modes(par, spec.layers, stage, spec.mtp_layers):
        runs = kept_runs(par, chunks)  # one input per group of layers recomputed as one
        if spec.is_moe or spec.mla is not None or par.cp > 1:
            total += sum(n * activation_bytes_per_layer(spec, b, t, sp, mode, trn.dtype, i,
                                                        par.cp, scenario.stack,
                                                        scenario.cp_keeps_gathered_kv,
                                                        par.cp_a2a_degree > 1)
                         for i, n in _kinds(spec, runs))
        else:
            per_layer = activation_bytes_per_layer(spec, b, t, sp, mode, trn.dtype,
                                                   stack=scenario.stack)
            total += per_layer * sum(len(r) for r in runs)
    tokens_h = b * spec.seq_len * spec.hidden * dtype_bytes(trn.dtype) / 2 / (t if sp else 1)
    if par.cp > 1:
        tokens_h /= par.cp
    if holds_embedding(par, stage) and scenario.stack.hidden_dropout > 0:
        total += tokens_h  # the embedding dropout mask (Korthikanti §4.3)
    if holds_head(par, stage):  # final-norm input and logits-GEMM input, 16-bit, per head
        total += 4 * tokens_h * (1 + spec.mtp_layers)
        total += spec.mtp_layers * mtp_kept(  # each MTP module's norms' and projection's inputs
            spec, b, t, sp, trn.dtype, scenario.stack, par.recompute) / par.cp
    return total * in_flight


def loss_tensors(scenario: Scenario) -> tuple[float, float]:
    """(saved, gradients) bytes of one micro-batch's loss on one rank of the last stage:
    what it keeps for its backward, the fp32 softmax (Megatron's vocab-parallel loss,
    PyTorch's log_softmax; under flash-attn's fused loss, ``stack.loss: flash``, the
    16-bit logits and a per-token fp32 log-sum-exp), and the gradient copies its backward
    holds besides: one (Megatron's loss writes it in place of the softmax; flash's a
    16-bit one), two under PyTorch's ``F.cross_entropy`` (``stack.loss: torch``: while
    ``log_softmax_backward_data`` writes its own gradient, aten/src/ATen/native/SoftMax.cpp,
    the fp32 gradient ``nll_loss_backward`` made of the log-probabilities,
    aten/src/ATen/native/LossNLL.cpp, a zeroed tensor of the input's shape, is still held,
    as FSDPMemTracker counts it: docs/memory.md)."""
    tokens, elements = _loss_elements(scenario)
    if scenario.stack.loss == "flash":
        dt = dtype_bytes(scenario.training.dtype)
        return dt * elements + 4.0 * tokens, dt * elements
    return 4.0 * elements, 4.0 * elements * (2 if scenario.stack.loss == "torch" else 1)


def logits(scenario: Scenario, stage: int) -> float:
    """What the loss holds on the last stage: the saved tensors of every micro-batch
    whose backward has not run and one backward's gradient copies (:func:`loss_tensors`).
    Each multi-token prediction module's loss holds as much again (one gradient serves
    them all: the losses' backward runs one after another)."""
    if not holds_head(scenario.parallel, stage):
        return 0.0
    saved, gradients = loss_tensors(scenario)
    return saved * _logits_held(scenario) + gradients


def logits_after_head(scenario: Scenario, stage: int) -> float:
    """What the loss still holds on the last stage once the first backward has run
    through the output layer: the saved tensors of the other micro-batches whose backward
    has not run (GPipe's m − 1, none where each backward follows its forward), no gradient
    copy (:func:`logits` less the running micro-batch's)."""
    if not holds_head(scenario.parallel, stage):
        return 0.0
    return loss_tensors(scenario)[0] * (_logits_held(scenario) - 1 - scenario.model.mtp_layers)


def metric_tensors(scenario: Scenario) -> float:
    """Bytes one micro-batch's training metrics hold on a rank of the last stage while the
    first runs (``stack.train_metrics``, :func:`simulator.model.inventory.loss.metric_ops`):
    its 16-bit logits, which the trainer keeps for them (Composer's ``state.outputs``), the
    fp32 copy autocast casts and log_softmax's output (under FP8 only the output, in the
    logits' dtype); 0 without metrics."""
    if not scenario.stack.train_metrics:
        return 0.0
    elements = _loss_elements(scenario)[1]
    dt = dtype_bytes(scenario.training.dtype)
    wide = metric_bytes(scenario.stack, dt)
    return dt * elements + wide * elements * (2 if wide != dt else 1)


def metric_logits(scenario: Scenario, stage: int) -> float:
    """What the loss's tensors hold on the last stage after a micro-batch's backward while
    the trainer computes its first training metric: :func:`metric_tensors` and the saved
    tensors of the micro-batches whose backward has not run (:func:`logits_after_head`); 0
    without metrics or the output layer."""
    held = metric_tensors(scenario)
    if not held or not holds_head(scenario.parallel, stage):
        return 0.0
    return held + logits_after_head(scenario, stage)


def _loss_elements(scenario: Scenario) -> tuple[float, float]:
    """(tokens, logits elements) of one micro-batch's loss on one rank."""
    par = scenario.parallel
    tokens = scenario.training.micro_batch * scenario.model.seq_len / par.cp
    return tokens, tokens * scenario.model.vocab / par.tp


def _logits_held(scenario: Scenario) -> int:
    """The losses whose saved tensors the last stage holds at its first backward: the
    schedule's micro-batches, each with its multi-token prediction modules' losses."""
    return schedule_spec(scenario.parallel.schedule).logits_held(scenario.microbatches) \
        * (1 + scenario.model.mtp_layers)


def rank_params(scenario: Scenario, dense: float, experts: float) -> float:
    """Parameters on one rank: dense ones split over tp, routed experts over
    expert_tp · ep (Megatron-LM's expert tensor and expert parallelism)."""
    par = scenario.parallel
    if not experts:
        return dense / par.tp
    return dense / par.tp + experts / (par.etp * par.ep)



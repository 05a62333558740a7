"""Transformer arithmetic: parameters, per-layer operations, FLOPs per step.

Pure functions over a :class:`~simulator.spec.model_spec.ModelSpec`; no SimPy and no
hardware. The cost model turns an :class:`Op` into time (roofline of ``flops``
against ``bytes`` with the profile's efficiency curves); this module only says
how much work there is.

Assumptions (Megatron-LM's, so the closed forms of Narayanan et al. SC'21 come
out exactly for a GPT block):

- FLOPs count matrix multiplies only, 2·M·N·K per GEMM; bias adds, norms,
  activations, softmax, dropout and residual adds are ``memory`` ops with zero FLOPs,
  costed by the bytes they read and write. A dense layer's ops are the kernel-level
  inventory of :mod:`simulator.model.inventory`, derived from model + training stack.
- Tensor parallelism splits QKV and MLP-up by columns and out-proj and
  MLP-down by rows (Megatron), so every GEMM's FLOPs divide by ``tp``. KV heads
  are split over TP ranks, or replicated when ``tp > kv_heads``. Fused QKV and,
  for SwiGLU, fused gate+up are one GEMM each.
- The attention core counts 4·b·s²·h/tp FLOPs forward (the full square, no causal
  halving, as Megatron counts), twice that backward, all of it in ``bwd_input``; the
  stack decides whether it runs as one FlashAttention call (Q, K, V, O bytes, causal
  blocks skipped) or unfused through the s×s scores. MoE and latent-attention layers
  (:mod:`simulator.model.moe`) keep the flash form.
- Backward is split as zero-bubble schedules need it: ``bwd_input`` holds the
  input-gradient GEMMs, the attention backward and the memory ops' backward;
  ``bwd_weight`` holds the weight-gradient GEMMs (and the embedding's scatter-add).
  Each GEMM's backward halves have its forward FLOPs, so a step is 3 × forward.
- With sequence parallelism the norms and residual adds work on s/tp tokens;
  without it every TP rank repeats them on all s tokens.
- Bytes use the training dtype; the loss keeps its softmax in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Literal

from simulator.model import moe
from simulator.model.comm_sizes import (  # noqa: F401  (re-exported: callers use mdl.*)
    pp_activation_bytes,
    tp_comm_bytes_per_layer,
    tp_end_bytes,
)
from simulator.model.inventory import mtp
from simulator.model.inventory.dense import dense_layer_ops
from simulator.model.inventory.experts import expert_tensors
from simulator.model.inventory.fp8 import step_weight_cast
from simulator.model.inventory.layer import fp8_expert_weights, fp8_weights, layer_tensors
from simulator.model.inventory.loss import loss_op, metric_ops
from simulator.model.inventory.ops import (
    Op,
    Pass,
    Shape,
    dtype_bytes,
    gemm,
    mem,
    norm_elements,
)
from simulator.model.inventory.optimizer import in_flat_shard, optimizer_op
from simulator.model.inventory.recompute_policy import recomputed_ops
from simulator.model.inventory.sharding import ROOT_TENSORS
from simulator.model.inventory.tensor_parallel import dtensor_tensors
from simulator.spec.model_spec import ModelSpec
from simulator.spec.recompute import ModeRuns
from simulator.spec.scenario import Scenario
from simulator.spec.stack import StackSpec, default_stack

#: a recomputation policy: none, selective, full, or the finer ones of
#: :mod:`simulator.model.inventory.recompute_policy` (``selective:<modules>``, ``op``)
RecomputeMode = str
PASSES: tuple[Pass, ...] = ("fwd", "bwd_input", "bwd_weight")


# ---------------------------------------------------------------- parameters


def _norm_params(spec: ModelSpec) -> int:
    return 2 * spec.hidden if spec.norm == "layernorm" else spec.hidden


def layer_params(spec: ModelSpec, layer: int = 0) -> int:
    """Layer ``layer``: attention (GQA-aware, or latent), MLP or experts, biases, two norms.

    Every layer of a dense model is the same, so ``layer`` matters only for a MoE model.
    """
    if spec.is_moe or spec.mla is not None:
        return moe.layer_params(spec, layer)
    h, q_width, kv_width = spec.hidden, spec.q_width, spec.kv * spec.head_size
    attention = 2 * h * q_width + 2 * h * kv_width  # q and out h×(a·head_dim); k, v h×(kv·head_dim)
    mlp_matrices = 3 if spec.activation == "swiglu" else 2
    mlp = mlp_matrices * h * spec.ffn
    biases = 0
    if spec.bias:
        biases = (q_width + h + 2 * kv_width) + ((mlp_matrices - 1) * spec.ffn + h)
    return attention + mlp + biases + 2 * _norm_params(spec)


def embedding_params(spec: ModelSpec) -> int:
    """Word embedding V·h, plus s·h learned positions."""
    positions = spec.seq_len * spec.hidden if spec.position == "learned" else 0
    return spec.vocab * spec.hidden + positions


def head_params(spec: ModelSpec) -> int:
    """Final norm plus the output projection (none extra when tied to the embedding), and
    beside them the multi-token prediction modules' norms and projections
    (:func:`~simulator.model.inventory.mtp.mtp_end_params`; their layers are layers)."""
    projection = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
    return _norm_params(spec) + projection + mtp.mtp_end_params(spec)


def param_count(spec: ModelSpec) -> int:
    """Total Ψ (a tied output projection counted once; the multi-token prediction
    modules' layers, norms and projections included, the embedding and output layer
    they share not again)."""
    layers = sum(n * layer_params(spec, i) for i, n in moe.all_layer_kinds(spec))
    return layers + embedding_params(spec) + head_params(spec)


def active_param_count(spec: ModelSpec, embedding: bool = True) -> int:
    """Parameters one token uses: a MoE layer's router, top-k routed and shared experts
    (not the other experts). Mistral counts the input embedding (12.9B for Mixtral
    8x7B), DeepSeek does not (36.6B for DeepSeek-V3): ``embedding`` chooses."""
    layers = sum(n * moe.active_layer_params(spec, i) for i, n in moe.layer_kinds(spec))
    return layers + (embedding_params(spec) if embedding else 0) + head_params(spec)


# ---------------------------------------------------------------- operations


def layer_ops(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    dtype: str = "bf16", pass_: Pass = "fwd", layer: int = 0, stack: StackSpec | None = None,
) -> tuple[Op, ...]:
    """One transformer layer's ops on one TP rank, in execution order (``layer``
    matters only for a mixture of experts, whose layers differ), as ``stack`` runs it
    (default :data:`simulator.spec.stack.DEFAULT_STACK`)."""
    st = stack or default_stack()
    if spec.is_moe or spec.mla is not None:
        return moe.layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, pass_, layer,
                             stack=st)
    return dense_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, pass_, st)


def embedding_ops(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    dtype: str = "bf16", pass_: Pass = "fwd", stack: StackSpec | None = None,
) -> tuple[Op, ...]:
    """First stage: the vocab-parallel lookup (and learned-position add), then the
    stack's embedding dropout.

    Every TP rank writes the full b·s·h output (zeros outside its vocabulary
    slice) before the all-reduce or reduce-scatter, so sequence parallelism does
    not change the bytes here. The input is token ids, so there is no input
    gradient: the backward (dropout's, then the scatter-add into the table) is a
    weight gradient.
    """
    del sequence_parallel  # see docstring
    st = stack or default_stack()
    # autocast leaves the lookup in the fp32 table's dtype
    dt, elements = st.fp32_under_amp(dtype_bytes(dtype)), micro_batch * spec.seq_len * spec.hidden
    per_token = 3.0 if spec.position == "learned" else 0.0  # read word + position, write sum
    keep = elements if pass_ == "fwd" else 0.0  # the 1-byte mask, kept for backward
    dropout = (Op("embedding_dropout", "memory", 0.0, (2 * dt + 1) * elements, 0.0,
                  "elementwise", 1, keep),) if st.hidden_dropout > 0 else ()
    if pass_ == "fwd":
        return (mem("embedding", (2.0 + per_token) * elements, dt, "copy", 1 + (per_token > 0)),
                *dropout)
    if pass_ == "bwd_weight":  # read dy, read-modify-write the touched rows (and positions)
        return (*dropout, mem("embedding", (3.0 + per_token) * elements, dt, "copy",
                               1 + (per_token > 0)))
    return ()


def head_ops(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    dtype: str = "bf16", pass_: Pass = "fwd", stack: StackSpec | None = None,
) -> tuple[Op, ...]:
    """Last stage: final norm, vocab-parallel logits GEMM, softmax + cross-entropy.

    The loss reads the 16-bit logits and keeps the softmax in fp32 for the
    backward, which reads it and writes the logits' gradient. Fused (one kernel each
    way) or as Megatron's vocab-parallel cross-entropy runs it: max, subtract, exp,
    sum, log, gather in fp32, about four fp32 passes over the logits in six kernels.
    """
    st = stack or default_stack()
    dt, tokens = dtype_bytes(dtype), micro_batch * spec.seq_len
    local = tokens / tp if sequence_parallel else tokens
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    logits = gemm("logits", tokens, spec.hidden, spec.vocab / tp, dt, cls)
    amp = st.amp(dt)  # autocast: the norm and the loss in fp32, a cast on each side of the GEMM
    wide = st.fp32_under_amp(dt)
    if pass_ == "bwd_weight":
        if st.fused_main_grads(dt):  # read-modify-write the fp32 main grad
            logits = replace(logits, bytes=logits.bytes
                             + (8 - dt) * spec.hidden * spec.vocab / tp)
        return (logits,)
    flash = st.loss == "flash"  # a custom kernel on the GEMM's 16-bit logits: no cast
    loss = loss_op(st, tokens * spec.vocab / tp, dt if flash else wide, pass_)
    casts = ((mem("amp_cast_head", tokens * spec.hidden, 4 + dt, "copy"),),
             () if flash else (mem("amp_cast_logits", tokens * spec.vocab / tp, 4 + dt,
                                   "copy"),)) if amp else ((), ())
    ops = (mem("final_norm", norm_elements(spec, local, pass_), wide, st.norm_classes[0]),
           *casts[0], logits, *casts[1], loss)
    return ops if pass_ == "fwd" else ops[::-1]


def train_metric_ops(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    dtype: str = "bf16", stack: StackSpec | None = None,
) -> tuple[Op, ...]:
    """The trainer's metric updates on one micro-batch's logits after its backward, on
    the stage with the output layer (:func:`simulator.model.inventory.loss.metric_ops`)."""
    del sequence_parallel  # the logits are every token's
    tokens = micro_batch * spec.seq_len
    return metric_ops(stack or default_stack(), tokens, tokens * spec.vocab / tp,
                      dtype_bytes(dtype))


def mtp_end_ops(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    dtype: str = "bf16", pass_: Pass = "fwd", stack: StackSpec | None = None,
) -> tuple[Op, ...]:
    """One multi-token prediction module's ops outside its transformer layer, in execution
    order: the shifted tokens' embedding lookup, the input norms and projection
    (:func:`~simulator.model.inventory.mtp.mtp_in_ops`), then its final norm, the shared
    output layer and the cross-entropy (:func:`head_ops`); the backward in reverse."""
    st = stack or default_stack()
    args = (spec, micro_batch, tp, sequence_parallel, dtype, pass_, st)
    ops = (*embedding_ops(*args), *mtp.mtp_in_ops(*args)) if pass_ == "fwd" else \
        (*mtp.mtp_in_ops(*args), *embedding_ops(*args))
    return (*ops, *head_ops(*args)) if pass_ == "fwd" else (*head_ops(*args), *ops)


def layer_recompute_ops(
    spec: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
    dtype: str = "bf16", recompute: RecomputeMode = "none", layer: int = 0,
    stack: StackSpec | None = None,
) -> tuple[Op, ...]:
    """Forward ops one layer re-runs before its backward.

    ``selective`` recomputes the attention core once (Korthikanti et al. 2022:
    QKᵀ, softmax, dropout, AV, or the one flash kernel), or with Megatron's
    ``--recompute-modules`` the modules' ops, and ``op`` what torchtitan's per-op policy
    does not save (:mod:`simulator.model.inventory.recompute_policy`); ``full`` re-runs
    the whole layer forward from its input.
    """
    if recompute == "none":
        return ()
    fwd = layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, "fwd", layer, stack)
    if recompute == "full":
        return fwd
    x = Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype),
              stack or default_stack())
    return recomputed_ops(x, fwd, recompute)


def optimizer_op_of(s: Scenario, shard: float, layers: Iterable[range],
                    part: Literal["dense", "experts", "all"] = "dense") -> Op:
    """The optimizer step on ``shard`` parameters of a rank holding the layer runs
    ``layers``, as the scenario's stack runs it (:func:`.inventory.optimizer.optimizer_op`),
    over the parameter tensors of ``part``: ``dense``, each layer's own (a MoE layer's
    without its routed experts) and the ends'; ``experts``, the routed experts' of the
    MoE layers among them (the expert pass's own step); ``all``, both in one step.
    Closed form over the runs' layer kinds (:func:`simulator.model.moe.layer_kinds`)."""
    spec, p = s.model, s.parallel
    kinds = [kind for run in layers for kind in moe.layer_kinds(spec, run.start, run.stop)]
    count = sum(n for _, n in kinds)
    flat = p.zero == 3 and s.stack.fsdp_flat_param  # a rank steps its shard's: in_flat_shard
    units = [(n, layer_tensors(spec, s.stack, i)) for i, n in kinds] + \
        [(1, ROOT_TENSORS + mtp.mtp_end_tensors(spec))] if part != "experts" else []
    if part != "dense" and spec.is_moe:
        local = expert_tensors(spec, s.stack, spec.experts // p.ep)
        units += [(n, local) for i, n in kinds if spec.is_moe_layer(i)]
    tensors = sum(n * in_flat_shard(t, p.shard if flat else 1) for n, t in units)
    dtensors = 0 if part == "experts" else \
        count * dtensor_tensors(spec, s.stack, p.tp, p.sequence_parallel)
    if p.zero == 3 and s.stack.dtensor:  # FSDP2: every sharded parameter is a DTensor
        dtensors = round(tensors)
    op = optimizer_op(shard, max(tensors, 1.0), s.stack, s.training.dtype, dtensors, flat,
                      cached=s.hardware.gpu.host_serial)  # a CPU's caches: see optimizer_op
    if s.stack.fp8 == "none" or s.stack.fp8_weight_cast != "step":
        return op
    # FP8 linears renew their cached FP8 weights once per step (on the first micro-batch's
    # forward): priced with the step, every TP-local weight, whatever the optimizer shards
    weights = [(n, fp8_weights(spec, s.stack, p.tp, i)) for i, n in kinds] \
        if part != "experts" else []
    if part != "dense":
        weights += [(n, fp8_expert_weights(spec, s.stack, p.ep, p.etp, i)) for i, n in kinds]
    elements, casts = sum(n * w for n, (w, _) in weights), sum(n * c for n, (_, c) in weights)
    if not casts:
        return op
    cast = step_weight_cast(s.stack.fp8, elements, casts)
    return replace(op, bytes=op.bytes + cast.bytes, kernels=op.kernels + cast.kernels)


def ops_flops(ops: tuple[Op, ...] | list[Op]) -> float:
    return sum(op.flops for op in ops)


# ---------------------------------------------------------------- FLOPs per step


def _all_passes(builder: Callable[..., tuple[Op, ...]], spec: ModelSpec, batch: int) -> float:
    return sum(ops_flops(builder(spec, batch, 1, False, "bf16", p)) for p in PASSES)


def _layer_flops(spec: ModelSpec, batch: int, layer: int, padded: bool) -> float:
    if not (spec.is_moe or spec.mla is not None):
        return _all_passes(layer_ops, spec, batch)
    return sum(ops_flops(moe.layer_ops(spec, batch, 1, False, "bf16", p, layer, padded))
               for p in PASSES)


def model_flops_per_step(spec: ModelSpec, global_batch: int) -> float:
    """Forward + backward of every layer, the logits and the loss, and of the multi-token
    prediction modules (their layers, projections and logits, as Megatron-LM's
    ``num_floating_point_operations`` counts them); no recomputation.

    FLOPs are linear in the batch, so the whole batch is one "micro-batch" here. A
    MoE layer counts the experts its tokens use (no capacity padding).
    """
    layers = sum(n * _layer_flops(spec, global_batch, i, padded=False)
                 for i, n in moe.all_layer_kinds(spec))
    return layers + _all_passes(head_ops, spec, global_batch) \
        + _all_passes(embedding_ops, spec, global_batch) \
        + spec.mtp_layers * _all_passes(mtp_end_ops, spec, global_batch)


def hardware_flops_per_step(spec: ModelSpec, global_batch: int,
                            recompute: RecomputeMode, modes: ModeRuns | None = None,
                            stack: StackSpec | None = None) -> float:
    """Model FLOPs plus the recomputed forward work and, with an expert capacity
    factor, the padded expert slots (what the GPUs actually execute). ``modes``: the
    layers grouped by recompute mode when only some are recomputed
    (:func:`simulator.spec.recompute.model_modes`). ``stack``: how the layer calls its
    linears, which torchtitan's per-op policy counts (default: the default stack)."""
    if modes is not None:
        return _partial_hardware_flops(spec, global_batch, modes)
    extra = 0.0
    for i, n in moe.all_layer_kinds(spec):
        extra += n * ops_flops(layer_recompute_ops(spec, global_batch, recompute=recompute,
                                                   layer=i, stack=stack))
        if spec.is_moe_layer(i) and spec.capacity_factor is not None:
            extra += n * (_layer_flops(spec, global_batch, i, padded=True)
                          - _layer_flops(spec, global_batch, i, padded=False))
    return model_flops_per_step(spec, global_batch) + extra \
        + mtp.mtp_recompute_flops(spec, global_batch, recompute)


def _partial_hardware_flops(spec: ModelSpec, global_batch: int, modes: ModeRuns) -> float:
    """:func:`hardware_flops_per_step` with each layer's own recompute mode (the
    multi-token prediction modules' is the mode that is not none)."""
    mode = next((m for m, _ in modes if m != "none"), "none")
    extra = mtp.mtp_recompute_flops(spec, global_batch, mode)
    for mode, runs in modes:
        for r in runs:
            extra += sum(n * ops_flops(layer_recompute_ops(spec, global_batch, recompute=mode,
                                                           layer=i))
                         for i, n in moe.run_kinds(spec, r))
    for i, n in moe.all_layer_kinds(spec):
        if spec.is_moe_layer(i) and spec.capacity_factor is not None:
            extra += n * (_layer_flops(spec, global_batch, i, padded=True)
                          - _layer_flops(spec, global_batch, i, padded=False))
    return model_flops_per_step(spec, global_batch) + extra


def megatron_model_flops(spec: ModelSpec, global_batch: int) -> float:
    """Narayanan et al. SC'21: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    B, s, L, h, V = global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    return 72.0 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))


def megatron_hardware_flops(spec: ModelSpec, global_batch: int,
                            recompute: RecomputeMode) -> float:
    """The quoted closed forms (docs/model.md): full 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)); selective
    (as quoted from Korthikanti et al. 2022) 72·B·s·l·h²·(1 + s/(3h) + V/(12lh))."""
    B, s, L, h, V = global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    if recompute == "full":
        return 96.0 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    if recompute == "selective":
        return 72.0 * B * s * L * h**2 * (1 + s / (3 * h) + V / (12 * L * h))
    return megatron_model_flops(spec, global_batch)


def megatron_param_count(spec: ModelSpec) -> float:
    """Narayanan et al. SC'21: Ψ = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    L, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
    return 12.0 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))

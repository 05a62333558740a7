"""A multi-token prediction module's own ops and parameters, its transformer layer apart.

DeepSeek-V3 (arXiv:2412.19437 §2.2) and Megatron-LM
(megatron/core/transformer/multi_token_prediction.py, ``MultiTokenPredictionLayer``):
depth k embeds the tokens shifted by k with the shared embedding, normalises that
(``enorm``) and the previous depth's hidden states (``hnorm``), concatenates the two
and projects 2h → h (``eh_proj``, a column-parallel linear without bias), runs one
transformer layer (priced as a layer of the model, :mod:`simulator.model.inventory.layer`)
and a final norm, then the shared output layer and a cross-entropy (the model's head
ops again, :func:`simulator.model.transformer.mtp_end_ops`). Here: the two input norms,
the concatenation and the projection, on one TP rank, in execution order.

Under full recomputation the input side runs again before the backward (the final norm
is left out: one norm); its inputs are then not kept (:func:`mtp_kept`).

Assumptions: the projection's FLOPs are 2·tokens·2h·h/tp each way, as Megatron-LM's
``num_floating_point_operations`` counts them; its TP collectives are the tensor pass's
(:func:`~simulator.model.inventory.tensor_parallel.tp_end_collectives`); the concatenation is
one copy of both halves, its backward a sum of the hidden states' two gradients.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.model.inventory.ops import (
    Op,
    Pass,
    dtype_bytes,
    gemm,
    mem,
    norm_elements,
    norm_tensors,
)
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec, default_stack

#: parameter tensors of one module outside its layer: three norms and the projection
MTP_NORMS = 3


def mtp_end_params(spec: ModelSpec) -> int:
    """Parameters of the ``mtp_layers`` modules outside their transformer layers: per
    module the embedding norm, the hidden-state norm, the final norm and the 2h × h
    projection (the embedding and the output layer are the model's, shared)."""
    norm = 2 * spec.hidden if spec.norm == "layernorm" else spec.hidden
    return spec.mtp_layers * (MTP_NORMS * norm + 2 * spec.hidden * spec.hidden)


def mtp_end_tensors(spec: ModelSpec) -> int:
    """Parameter tensors of :func:`mtp_end_params` (the optimizer's per-tensor kernels)."""
    return spec.mtp_layers * (MTP_NORMS * norm_tensors(spec) + 1)


def mtp_in_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
               dtype: str, pass_: Pass, stack: StackSpec) -> tuple[Op, ...]:
    """One module's input side on one TP rank: ``enorm`` and ``hnorm`` (on s/tp tokens
    under sequence parallelism), the concatenation and ``eh_proj``; the backward in
    reverse, the projection's weight gradient in ``bwd_weight``."""
    dt, tokens = dtype_bytes(dtype), float(micro_batch * spec.seq_len)
    local = tokens / tp if sequence_parallel else tokens
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    proj = gemm("mtp_proj", tokens, 2 * spec.hidden, spec.hidden / tp, dt, cls,
                saved=dt * local * 2 * spec.hidden if pass_ == "fwd" else 0.0)
    if pass_ == "bwd_weight":
        if stack.fused_main_grads(dt):  # read-modify-write the fp32 main grad
            proj = replace(proj, bytes=proj.bytes + (8 - dt) * 2 * spec.hidden * spec.hidden / tp)
        return (proj,)
    wide = stack.fp32_under_amp(dt)
    norm = norm_elements(spec, local, pass_)
    saved = wide * local * spec.hidden if pass_ == "fwd" else 0.0
    # forward: the concatenation copies both halves (read, write); backward: its gradient
    # splits into views, and the previous depth's hidden states sum the gradient from
    # hnorm with their own (read two, write one)
    join = mem("mtp_concat", 2 * 2 * local * spec.hidden, dt, "copy") if pass_ == "fwd" else \
        mem("mtp_grad_sum", 3 * local * spec.hidden, dt, "elementwise")
    cls = stack.norm_classes[0]
    ops = (mem("mtp_enorm", norm, wide, cls, saved=saved),
           mem("mtp_hnorm", norm, wide, cls, saved=saved), join, proj)
    return ops if pass_ == "fwd" else ops[::-1]


def mtp_recompute_flops(spec: ModelSpec, global_batch: int, recompute: str) -> float:
    """FLOPs of the modules' input sides again under full recomputation (their layers
    recompute as layers), for ``global_batch`` sequences."""
    if recompute != "full" or not spec.mtp_layers:
        return 0.0
    return spec.mtp_layers * sum(op.flops for op in mtp_in_ops(
        spec, global_batch, 1, False, "bf16", "fwd", default_stack()))


def mtp_kept(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
             dtype: str, stack: StackSpec, recompute: str) -> float:
    """Bytes one module's input side keeps for its backward, its layer's apart: the norms'
    and the projection's inputs; under full recomputation, where Megatron-LM checkpoints
    the projection, the layer and the final norm as one call
    (``MultiTokenPredictionLayer._checkpointed_forward``), the call's second input, the
    shifted tokens' embedding (the first, the previous depth's hidden states, is the
    layer's kept input)."""
    if recompute == "full":
        local = micro_batch * spec.seq_len / (tp if sequence_parallel else 1)
        return dtype_bytes(dtype) * local * spec.hidden
    return sum(op.saved for op in mtp_in_ops(spec, micro_batch, tp, sequence_parallel, dtype,
                                             "fwd", stack))

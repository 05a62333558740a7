"""What a recomputation policy re-runs before a layer's backward and what the layer keeps,
read off the layer's forward ops (each :class:`~simulator.model.inventory.ops.Op` names
itself and carries the bytes it saves), so every consumer (memory, the engine's tasks,
the analytic estimate, hardware FLOPs) asks one place.

A policy is a string (hashable, for the cached callers): ``none``, ``full`` (handled by
the callers: everything recomputed, the input kept), ``selective`` (the attention core,
Megatron-Core's default ``--recompute-modules core_attn``), ``selective:<modules>``
(Megatron-Core's ``--recompute-granularity selective --recompute-modules ...``, the
modules in the order of
:func:`simulator.spec.recompute.module_names`) and ``op`` (torchtitan's per-op selective
checkpointing, :func:`op_sac`).

Megatron-Core's modules (``TransformerConfig.recompute_modules``,
``megatron/core/transformer/transformer_config.py`` at commit d98e8a64 of 2026-08-22,
where each is applied):

* ``core_attn``: ``Attention._checkpointed_attention_forward``
  (``transformer/attention.py``): the core re-run from Q, K and V, which it keeps
  instead of its internals (a flash core: its fp32 log-sum-exp); a latent-attention
  core keeps what it kept (its inputs).
* ``layernorm``: ``TransformerLayer`` (``transformer_layer.py``,
  ``recompute_input_layernorm`` / ``recompute_pre_mlp_layernorm``) wraps both norms in
  ``CheckpointWithoutOutput`` (``tensor_parallel/random.py``): the normed output the
  next linear (QKV, the latent down-projection, the MLP's up or the router) keeps is
  freed and rebuilt from the norm's input.
* ``mlp``: the dense MLP under ``tensor_parallel.checkpoint`` (not a MoE layer's):
  it keeps its input (the normed tokens), drops its activation's and down-projection's.
* ``moe``: ``MoELayer`` (``moe/moe_layer.py``, ``moe_layer_recompute``): the whole MoE
  block (router, permutation, shared and routed experts) from its input.
* ``shared_experts``: ``SharedExpertMLP`` under ``tensor_parallel.checkpoint``
  (``moe/moe_layer.py``): their activation's and down-projection's inputs dropped.
* ``moe_act``: the routed experts' activation under ``CheckpointWithoutOutput``
  (``moe/experts.py``): its output (the down-projection's input) dropped.
* ``mla_up_proj``: ``MultiLatentAttention`` (``multi_latent_attention.py``,
  ``qkv_up_checkpoint``): the up-projections and RoPE re-run from the latents; Q, K
  and V, which the core kept, dropped.

A recomputed block issues again the collectives its framework's checkpointed function
contains (:func:`reissued`), with the forward's bytes, on the forward's streams.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from simulator.model.inventory import fp8
from simulator.model.inventory.experts import routed_tokens
from simulator.model.inventory.ops import CORE_OPS, Op, Shape
from simulator.spec.recompute import modules_of

Drop = Callable[[float], float]  # the bytes dropped of what an op saved


@dataclass
class Effect:
    """What a module does to one layer: the forward ops it re-runs (by name), the bytes
    it drops from what ops keep (by op name), the tensors it keeps instead."""

    recompute: set[str] = field(default_factory=set)
    drops: dict[str, list[Drop]] = field(default_factory=dict)
    extra: tuple[float, ...] = ()

    def drop(self, name: str, fn: Drop) -> None:
        self.drops.setdefault(name, []).append(fn)


def _all(saved: float) -> float:
    return saved


def _first_gemm_after(ops: tuple[Op, ...], norm: str) -> Op | None:
    """The first linear after norm ``norm`` that keeps something: the one that keeps the
    normed tokens (QKV or the latent down-projection; the MLP's up or the router)."""
    names = [op.name for op in ops]
    if norm not in names:
        return None
    return next((op for op in ops[names.index(norm) + 1:] if op.kind == "gemm" and op.saved),
                None)


def _mlp_block(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """The MLP block's forward ops: after ``ln2``, before the layer's last residual."""
    names = [op.name for op in ops]
    last = len(names) - 1 - names[::-1].index("residual")
    return ops[names.index("ln2") + 1:last]


def _normed(x: Shape) -> float:
    return x.dt * x.local * x.spec.hidden


def _core_attn(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    e.recompute |= {op.name for op in ops if op.name in CORE_OPS}
    if x.spec.mla is None:  # the internals give way to Q, K and V
        for name in CORE_OPS:
            e.drop(name, _all)
        e.extra += tuple(x.dt * x.tokens * width for width in (x.q, x.kv, x.kv))


def _layernorm(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    e.recompute |= {"ln1", "ln2"}
    normed = _normed(x)
    for norm in ("ln1", "ln2"):
        op = _first_gemm_after(ops, norm)
        if op is not None:
            e.drop(op.name, lambda saved: min(saved, normed))


def _submodule(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    """``mlp`` on a dense layer, ``moe`` on a MoE layer: the block from its input (the
    normed tokens, which its first linear keeps)."""
    block = _mlp_block(ops)
    e.recompute |= {op.name for op in block}
    first = _first_gemm_after(ops, "ln2")
    normed = _normed(x)
    for op in block:
        if op is first:
            e.drop(op.name, lambda saved: max(saved - normed, 0.0))
        else:
            e.drop(op.name, _all)


def _mlp(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    if not any(op.name == "router" for op in ops):
        _submodule(x, ops, e)


def _moe(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    if any(op.name == "router" for op in ops):
        _submodule(x, ops, e)


def _shared_experts(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    for op in ops:
        if op.name.startswith("shared_"):
            e.recompute.add(op.name)
            e.drop(op.name, _all)


def _moe_act(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    names = {op.name for op in ops}
    if "expert_act" not in names:
        return
    e.recompute.add("expert_act")
    kb = 1 if fp8.active(x) else x.dt  # an FP8 down-projection keeps its input's FP8 copy
    out = kb * routed_tokens(x.spec, x.tokens, True) * x.spec.expert_ffn / x.tp
    # its output is the down-projection's kept input (a latent-attention layer's
    # coarser ops keep it with the activation)
    holder = "expert_down" if any(op.name == "expert_down" and op.saved for op in ops) \
        else "expert_act"
    e.drop(holder, lambda saved: min(saved, out))


def _mla_up_proj(x: Shape, ops: tuple[Op, ...], e: Effect) -> None:
    mla = x.spec.mla
    if mla is None:
        return
    e.recompute |= {"q_up", "kv_up"}
    qkv = x.dt * x.tokens * x.spec.heads * (2 * mla.qk_head_dim + mla.v_head_dim) / x.tp
    e.drop("attn_core", lambda saved: min(saved, qkv))


#: each module's effect on a layer's forward ops (a module that does not apply to the
#: layer, ``mlp`` on a MoE layer, ``moe_act`` on a dense one, leaves it as it is)
MODULE_EFFECTS: dict[str, Callable[[Shape, tuple[Op, ...], Effect], None]] = {
    "core_attn": _core_attn, "moe_act": _moe_act, "layernorm": _layernorm,
    "mla_up_proj": _mla_up_proj, "mlp": _mlp, "moe": _moe, "shared_experts": _shared_experts,
}


def _effect(x: Shape, fwd: tuple[Op, ...], policy: str) -> Effect:
    e = Effect()
    for module in modules_of(policy):
        MODULE_EFFECTS[module](x, fwd, e)
    return e


def recomputed_ops(x: Shape, fwd: tuple[Op, ...], policy: str) -> tuple[Op, ...]:
    """The forward ops ``policy`` re-runs before the layer's backward, forward order
    (``full`` and ``none`` are the callers')."""
    if policy == "op":
        return op_sac(x, fwd)[0]
    names = _effect(x, fwd, policy).recompute
    return tuple(op for op in fwd if op.name in names)


def kept_tensors(x: Shape, fwd: tuple[Op, ...], policy: str) -> tuple[float, ...]:
    """The tensors (bytes) the layer keeps for its backward under ``policy``: what each
    forward op saves less what the modules drop, then what they keep instead."""
    if policy == "op":
        return op_sac(x, fwd)[1]
    e = _effect(x, fwd, policy)
    kept = []
    for op in fwd:
        left = op.saved - sum(fn(op.saved) for fn in e.drops.get(op.name, ()))
        if op.saved > 0 and left > 0:
            kept.append(left)
    return (*kept, *e.extra)


# ---------------------------------------------------------------- torchtitan's op SAC


def _linear_widths(x: Shape, op: Op) -> tuple[float, ...]:
    """The output width of each call of a layer's linear ``op``: separate q, k and v (or
    gate and up) projections are calls of their own."""
    f = x.spec.ffn / x.tp
    if op.name == "qkv":
        return (x.q, x.kv, x.kv) if op.kernels == 3 else (x.q + 2 * x.kv,)
    if op.name == "mlp_up":
        return (f, f) if op.kernels == 2 else (x.up,)
    return (float(x.spec.hidden),)  # out_proj, mlp_down: the (partial) hidden states


def _core_output(x: Shape) -> float:
    """What an SDPA call returns: its output and, flash, the fp32 log-sum-exp per head;
    the math kernel its attention weights."""
    heads = x.spec.heads / x.tp
    extra = 4 * x.tokens * heads if x.st.flash else x.dt * x.scores
    return x.dt * x.tokens * x.q + extra


def op_sac(x: Shape, fwd: tuple[Op, ...]) -> tuple[tuple[Op, ...], tuple[float, ...]]:
    """torchtitan's per-op selective checkpointing of a dense layer: (the ops re-run, the
    tensors kept). ``_get_custom_policy`` (``torchtitan/distributed/
    activation_checkpoint.py``, ``SelectiveAC._wrap_block`` at commit b5bcd76c of
    2026-08-21; ``_apply_op_sac`` with the models' ``_op_sac_save_list`` before) saves
    the outputs of the ops in its save list (``_get_default_save_ops``: ``mm`` and
    ``linear``, the SDPA and flash kernels, ``reduce_scatter_tensor``, ``max``) except
    every second ``mm`` of the block, counted from 1 in forward order, and recomputes
    everything else from the block's input, which the checkpoint keeps. So: of the
    linears' calls the 1st, 3rd, ... keep their output and the 2nd, 4th, ... re-run;
    the attention core keeps its output (:func:`_core_output`); with sequence
    parallelism the two reduce-scatters keep theirs; norms, RoPE, the activation, the
    residuals and dropouts re-run. ``max`` (FP8 scaling) keeps a scalar, left out."""
    kept = [x.rs * x.local * x.spec.hidden]
    again: list[Op] = []
    count = 0
    for op in fwd:
        if op.name in CORE_OPS:
            if op is next(o for o in fwd if o.name in CORE_OPS):
                kept.append(_core_output(x))
            continue
        if op.kind != "gemm":
            again.append(op)
            continue
        widths = _linear_widths(x, op)
        redo = []
        for width in widths:
            count += 1
            if count % 2:
                kept.append(x.dt * x.tokens * width)
            else:
                redo.append(width)
        if redo:
            share = math.fsum(redo) / math.fsum(widths)
            again.append(replace(op, flops=op.flops * share, bytes=op.bytes * share,
                                 kernels=len(redo), dtensor=min(op.dtensor, len(redo))))
        if op.name in ("out_proj", "mlp_down") and x.tp > 1 and x.sp:
            kept.append(x.dt * x.local * x.spec.hidden)  # the reduce-scatter's output
    return tuple(again), tuple(kept)

"""Mixture-of-experts layers and multi-head latent attention: parameters and operations.

:mod:`simulator.model.transformer` hands a layer to this module when the model has routed
experts (``experts > 0``) or latent attention (``mla``); a dense GQA model never
comes here, so its arithmetic stays what it was. Pure functions, no SimPy.

Mixture of experts (Shazeer et al. 2017; Fedus et al. 2022, Switch Transformer;
Mixtral; DeepSeek-V3):

- A MoE layer keeps the attention and the two norms and replaces the MLP by a
  router (an h × E GEMM, with an E bias for DeepSeek's sigmoid router), E routed
  experts of which each token uses k, and ``shared_experts`` that every token
  uses; each expert is an MLP of width ``expert_ffn_hidden`` (three matrices for
  SwiGLU). Shared experts run as one MLP of width shared · f_e, as Megatron-LM
  fuses them (``moe_shared_expert_intermediate_size``).
- Routed work per token is k experts: dropless routing computes exactly the
  routed tokens (balanced: T·k/E per expert); a capacity factor c gives every
  expert a buffer of c·k·T/E tokens (GShard, Switch; Megatron with
  ``--moe-pad-expert-input-to-capacity``), computed whether full or not. Model
  FLOPs count min(c, 1)·k·T tokens (what the model computes for the tokens it
  keeps), hardware FLOPs c·k·T.
- Tensor parallelism splits expert and shared-expert matrices like the dense MLP
  (Megatron's expert tensor parallelism, by default the TP degree); the router is
  replicated. Token permutation before the experts and the weighted un-permutation
  after them are memory-bound copies of k·T·h elements.
- An op's ``gemm_flops`` (the efficiency-curve lookup) is one expert's GEMM:
  experts run as a grouped GEMM of E small products.

Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1) in its training
form (no weight absorption): h → q latent (q_lora_rank, RMS-normed) → H queries of
width d_nope + d_rope; h → kv latent (kv_lora_rank, RMS-normed) plus one shared
RoPE key of width d_rope; kv latent → H keys (d_nope) and values (d_v); out-proj
H·d_v → h. Parameters and GEMM FLOPs are exact. The attention core is
2·b·s²·H·(d_qk + d_v) forward, as a FlashAttention call with those head widths
computes it. The down-projections are replicated across TP ranks, as
Megatron-core builds them (``linear_q_down_proj`` / ``linear_kv_down_proj`` are
plain, not column-parallel, linears in ``megatron/core/models/gpt/gpt_layer_specs.py``);
the up-projections and the out-proj split by heads. Approximate: the memory-bound
bytes of the latent norms and of the RoPE applied to the decoupled key, and the
stored activations (:func:`activation_bytes`), which count the latents, Q, K, V and
the out-proj input at their widths.
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.model.inventory import fp8
from simulator.model.inventory.dense import dense_layer_ops
from simulator.model.inventory.experts import moe_layer_ops, moe_mlp_ops, routed_tokens
from simulator.model.inventory.mla import linear, mla_ops
from simulator.model.inventory.ops import (
    Op,
    Pass,
    Shape,
    act_elements,
    dtype_bytes,
    mem,
    norm_elements,
)
from simulator.spec.model_spec import MLASpec, ModelSpec
from simulator.spec.stack import StackSpec, default_stack


def layer_kinds(spec: ModelSpec, start: int = 0, stop: int | None = None
                ) -> list[tuple[int, int]]:
    """(a representative layer index, how many layers are like it) among layers
    start..stop-1 (default all): one entry for a dense model, a dense and a MoE entry
    for a mixture of experts. Closed form: no loop over the layers. Layers from
    ``spec.layers`` on are multi-token prediction layers, of the last layer's kind."""
    stop = spec.layers if stop is None else stop
    if stop > spec.layers:  # the MTP layers join the entry of their kind
        mtp = stop - max(start, spec.layers)
        kinds = layer_kinds(spec, start, spec.layers) if start < spec.layers else []
        kind = spec.is_moe_layer(spec.layers)
        for j, (i, n) in enumerate(kinds):
            if spec.is_moe_layer(i) == kind:
                kinds[j] = (i, n + mtp)
                return kinds
        return [*kinds, (max(start, spec.layers), mtp)]
    f, freq = spec.first_dense_layers, spec.moe_layer_freq
    lo = max(start, f)
    first_moe = f + -(-(lo - f) // freq) * freq
    moe_count = 0 if not spec.is_moe or first_moe >= stop else (stop - 1 - first_moe) // freq + 1
    if moe_count == 0:
        return [(start, stop - start)] if stop > start else []
    kinds = [(first_moe, moe_count)]
    if stop - start > moe_count:  # the first dense layer in the range
        dense = start if not spec.is_moe_layer(start) else start + 1
        kinds.insert(0, (dense, stop - start - moe_count))
    return kinds


def all_layer_kinds(spec: ModelSpec) -> list[tuple[int, int]]:
    """:func:`layer_kinds` of every layer, the multi-token prediction modules' (numbered
    from ``spec.layers`` on) included."""
    return layer_kinds(spec, 0, spec.layers + spec.mtp_layers)


def run_kinds(spec: ModelSpec, run: range) -> list[tuple[int, int]]:
    """:func:`layer_kinds` of a range of layers, a stepped one too (the every k-th layers
    of a partial recomputation, :mod:`simulator.spec.recompute`): closed form for a
    contiguous run or a dense model; for a stepped run of a MoE, its MoE layers (at or
    past first_dense_layers, every moe_layer_freq-th) are the j with
    j · step ≡ first_dense_layers − tail[0] (mod moe_layer_freq), one residue class of j
    (a modular inverse), so closed form too."""
    if run.step == 1:
        return layer_kinds(spec, run.start, run.stop)
    if not spec.is_moe or not run:
        return [(run.start, len(run))] if run else []
    f, freq, k = spec.first_dense_layers, spec.moe_layer_freq, run.step
    tail = run[len(range(run.start, min(run.stop, f), k)) if run.start < f else 0:]
    g = math.gcd(k, freq)
    routed = range(0)
    if tail and (f - tail[0]) % g == 0:
        period = freq // g
        j0 = (f - tail[0]) // g * pow(k // g, -1, period) % period if period > 1 else 0
        routed = tail[j0::period]
    if not routed:
        return [(run.start, len(run))]
    dense = len(run) - len(routed)
    if not dense:
        return [(routed[0], len(routed))]
    first_dense = run[0] if run[0] != routed[0] else run[1]
    return [(first_dense, dense), (routed[0], len(routed))]


# ---------------------------------------------------------------- parameters


def _norm(spec: ModelSpec, width: int) -> int:
    return 2 * width if spec.norm == "layernorm" else width


def mla_params(spec: ModelSpec, mla: MLASpec) -> int:
    """Latent attention: down- and up-projections, the two latent norms, out-proj."""
    h, heads = spec.hidden, spec.heads
    if mla.q_lora_rank:
        q = h * mla.q_lora_rank + _norm(spec, mla.q_lora_rank) \
            + mla.q_lora_rank * heads * mla.qk_head_dim
    else:
        q = h * heads * mla.qk_head_dim
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + _norm(spec, mla.kv_lora_rank) \
        + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + heads * mla.v_head_dim * h


def attention_params(spec: ModelSpec) -> int:
    if spec.mla is not None:
        return mla_params(spec, spec.mla)
    h, q_width, kv_width = spec.hidden, spec.q_width, spec.kv * spec.head_size
    return 2 * h * q_width + 2 * h * kv_width + ((q_width + h + 2 * kv_width) if spec.bias else 0)


def mlp_params(spec: ModelSpec, width: int) -> int:
    """One MLP of inner ``width`` (and its biases)."""
    matrices = 3 if spec.activation == "swiglu" else 2
    biases = ((matrices - 1) * width + spec.hidden) if spec.bias else 0
    return matrices * spec.hidden * width + biases


def router_params(spec: ModelSpec) -> int:
    return spec.hidden * spec.experts + (spec.experts if spec.router == "sigmoid" else 0)


def expert_params(spec: ModelSpec, layer: int) -> int:
    """The routed experts of ``layer`` (what expert parallelism splits); 0 if dense."""
    return spec.experts * mlp_params(spec, spec.expert_ffn) if spec.is_moe_layer(layer) else 0


def layer_params(spec: ModelSpec, layer: int) -> int:
    common = attention_params(spec) + 2 * _norm(spec, spec.hidden)
    if not spec.is_moe_layer(layer):
        return common + mlp_params(spec, spec.ffn)
    shared = mlp_params(spec, spec.shared_experts * spec.expert_ffn) if spec.shared_experts \
        else 0
    return common + router_params(spec) + shared + expert_params(spec, layer)


def active_layer_params(spec: ModelSpec, layer: int) -> int:
    """What one token uses: all of a dense layer; of a MoE layer all but E − k experts."""
    unused = (spec.experts - spec.experts_per_token) * mlp_params(spec, spec.expert_ffn)
    return layer_params(spec, layer) - (unused if spec.is_moe_layer(layer) else 0)


# ---------------------------------------------------------------- operations


#: what expert parallelism moves: the routed experts' ops (the layer lists them for its
#: FLOPs and what it keeps; the expert pass prices them on the ranks that hold the experts)
ROUTED_OPS = ("expert_up", "expert_act", "expert_down", "expert_buffers", "expert_bias_grad",
              "fp8_x_expert_up", "fp8_x_expert_down", "fp8_dy_expert_up",
              "fp8_dy_expert_down", "fp8_w_expert_up", "fp8_w_expert_down",
              "expert_amp_weight_cast", "expert_grad_accum", "expert_main_grad")


# ---------------------------------------------------------------- activations


def kept_bytes(spec: ModelSpec, layer: int, b: int, tp: int, sequence_parallel: bool,
               dt: int, masks: bool, fp8_inputs: bool = False,
               deepseek: bool = False) -> dict[str, float]:
    """Bytes a latent-attention model's layer (MoE or dense) keeps for the backward, by op
    name (:func:`layer_ops` hands them to its ops; :mod:`simulator.model.memory` sums them); its
    flash attention core keeps no s×s scores. Per token, in 16-bit units scaled by the
    dtype (``dt / 2``):

    - the frame, as for any layer: the two norms' inputs and the inputs of the first
      attention GEMM and of the MLP (the router), 2h each (sharded under sequence
      parallelism), and with hidden dropout one 1-unit mask per residual add;
    - attention: the two latents and the RoPE key (replicated), Q and K of width H·d_qk,
      V and the out-proj input of width H·d_v (split over TP), all with the core;
    - a MoE layer: fp32 router probabilities (4·E per token, with the router), the k
      (or c·k) permuted copies of each token (the experts' input, with the
      permutation), the experts' activation inputs and outputs (with their
      activation), the shared experts' likewise; a dense layer of such a model its
      MLP activation's;
    - under ``stack.fp8`` (``fp8_inputs``) the FP8 linears' inputs at 1 byte
      (:func:`_fp8_kept`), and with ``deepseek`` (``stack.fp8_cache: deepseek``) the
      out-proj input at E5M6's 1.5 bytes and the routed experts' activation inputs at 1
      (:mod:`simulator.model.inventory.fp8`).
    """
    h, t, tokens = spec.hidden, tp, float(b * spec.seq_len)
    scale = dt / 2
    rep = 1 / t if sequence_parallel else 1.0
    local = tokens * rep
    mla = spec.mla
    if mla is None:
        raise ValueError("kept_bytes is for latent attention; the inventory keeps the rest")
    first = "q_down" if mla.q_lora_rank else "q_up"
    out: dict[str, float] = {"ln1": 2 * local * h, first: 2 * local * h,
                             "ln2": 2 * local * h, "residual": local * h if masks else 0.0}
    out["attn_core"] = tokens * (
        2 * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim)
        + 2 * (2 * spec.heads * mla.qk_head_dim + 2 * spec.heads * mla.v_head_dim) / t)
    mlp_unit = 6.0 if spec.activation == "swiglu" else 4.0
    if not spec.is_moe_layer(layer):
        out["mlp_up"] = 2 * local * h
        out["act"] = tokens * mlp_unit * spec.ffn / t
    else:
        routed = routed_tokens(spec, tokens, padded=True)
        out["router"] = 2 * local * h + local * 4 * spec.experts
        out["permute"] = routed * 2 * h
        out["expert_act"] = routed * mlp_unit * spec.expert_ffn / t
        if spec.shared_experts:
            out["shared_act"] = tokens * mlp_unit * spec.shared_experts * spec.expert_ffn / t
    kept = {name: v * scale for name, v in out.items()}
    if not fp8_inputs:
        return kept
    return _fp8_kept(spec, mla, layer, kept, (tokens, local), tp, dt, deepseek)


def _fp8_kept(spec: ModelSpec, mla: MLASpec, layer: int, kept: dict[str, float],
              rows: tuple[float, float], tp: int, dt: int,
              deepseek: bool = False) -> dict[str, float]:
    """:func:`kept_bytes` under ``stack.fp8``: each FP8 linear keeps its input's
    column-wise FP8 copy, 1 byte an element (Transformer Engine's ``_Linear`` and
    ``_GroupedLinear`` save the quantized input, :mod:`simulator.model.inventory.fp8`):
    the two down-projections a copy each of the normed tokens (one 16-bit tensor
    before; both counted with the first, which recomputing the norm drops as it drops
    the 16-bit one), the out-proj its input (beside the 16-bit output the core keeps for its
    own backward), the dense MLP's and the routed experts' linears
    theirs. The latents stay as counted (once, 16-bit: the latent norms' inputs), so do
    Q, K, V, the router's input and probabilities, the activations' inputs and the
    shared experts' (16-bit linears here). ``rows``: the layer's tokens and its local
    (sequence-parallel) share. With ``deepseek`` (DeepSeek-V3's caching) the out-proj input
    is kept in E5M6 and the routed experts' activation inputs in FP8."""
    (tokens, local), h = rows, spec.hidden
    out = {**kept, "q_down" if mla.q_lora_rank else "q_up": 2 * local * h}  # both copies
    o = tokens * spec.heads * mla.v_head_dim / tp  # the core's output: the out-proj's input
    # DeepSeek-V3 keeps it once in E5M6 for both backwards; an FP8 linear keeps its 1-byte
    # copy beside the 16-bit output the fused core keeps (attention.own_output)
    out["attn_core"] += -(dt - fp8.E5M6_BYTES) * o if deepseek else 1.0 * o
    if not spec.is_moe_layer(layer):
        out["mlp_up"] = local * h
        out["act"] -= (dt - 1) * tokens * spec.ffn / tp
        return out
    routed = routed_tokens(spec, tokens, padded=True)
    out["permute"] = routed * h
    inputs = (2 if spec.activation == "swiglu" else 1) if deepseek else 0
    out["expert_act"] -= (dt - 1) * routed * (1 + inputs) * spec.expert_ffn / tp
    return out


# ---------------------------------------------------------------- a whole layer


def _dense_mlp_ops(spec: ModelSpec, micro_batch: int, tp: int, dt: int, pass_: Pass,
                   st: StackSpec, local: float) -> list[Op]:
    tokens, h, f = micro_batch * spec.seq_len, spec.hidden, spec.ffn / tp
    up = (2 if spec.activation == "swiglu" else 1) * f
    return [*linear(st, "mlp_up", tokens, h, up, dt, pass_, local * h),
            mem("act", act_elements(spec, tokens, tp, pass_), dt),
            *linear(st, "mlp_down", tokens, f, h, dt, pass_, tokens * f)]


def layer_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool, dtype: str,
              pass_: Pass, layer: int, padded: bool = True,
              stack: StackSpec | None = None) -> tuple[Op, ...]:
    """Layer ``layer`` of a MoE or latent-attention model on one TP rank, in execution
    order. With standard attention the kernel-level inventory as ``stack`` runs it
    (:func:`simulator.model.inventory.experts.moe_layer_ops` for a routed-experts layer, the dense
    layer's for the others). With latent attention the coarser list here (the same
    frame: norm, attention, residual, norm, MLP or experts, residual), whose forward
    ops carry what they keep for the backward (:func:`kept_bytes`; a mask per residual
    add where the stack has hidden dropout)."""
    st = stack or default_stack()
    if spec.mla is None:
        if spec.is_moe_layer(layer):
            return moe_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, pass_, st,
                                     padded)
        return dense_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, pass_, st)
    masks = st.hidden_dropout > 0
    dt = dtype_bytes(dtype)
    tokens = micro_batch * spec.seq_len
    local = tokens / tp if sequence_parallel else tokens
    # the core keeps the flash form whatever the stack (an unfused one's: FlashAttention-2)
    attention = mla_ops(spec, spec.mla, micro_batch, tp, dt, pass_,
                        st.attention if st.flash else "flash2", st, local)
    if spec.is_moe_layer(layer):
        mlp = moe_mlp_ops(spec, micro_batch, tp, sequence_parallel, dtype, pass_, st,
                              padded)
    else:
        mlp = _dense_mlp_ops(spec, micro_batch, tp, dt, pass_, st, local)
    if pass_ == "bwd_weight":
        return tuple(op for op in (*attention, *mlp) if op.kind == "gemm")
    residual = mem("residual", 3.0 * local * spec.hidden, dt)
    norm = st.norm_classes[0]
    ops = (mem("ln1", norm_elements(spec, local, pass_), dt, norm), *attention,
           residual, mem("ln2", norm_elements(spec, local, pass_), dt, norm), *mlp,
           residual)
    if fp8.on(st):  # delayed scaling's update, after the pass
        x = Shape(spec, micro_batch, tp, sequence_parallel, dt, st)
        linears = sum(op.kernels for op in ops if op.precision == "fp8")
        ops = (*ops, *fp8.scale_update(x, linears, pass_))
    if pass_ != "fwd":
        return ops[::-1]
    kept = kept_bytes(spec, layer, micro_batch, tp, sequence_parallel, dt, masks, fp8.on(st),
                      fp8.deepseek(st))
    # an FP8 weight cast every micro-batch keeps its column-wise copy (fp8.around)
    return tuple(replace(op, saved=kept.get(op.name, op.saved if op.name.startswith("fp8_w_")
                                            else 0.0)) for op in ops)

"""Multi-head latent attention's operations on one TP rank (DeepSeek-V2 §2.1, DeepSeek-V3
§2.1.1; :mod:`simulator.model.moe` describes the layer and counts its parameters): its
linears, 16-bit or FP8 with their casts, and the attention core.
"""

from __future__ import annotations

from simulator.model.inventory import fp8
from simulator.model.inventory.ops import FLASH_BWD_KERNELS, Op, Pass, flash_scale, gemm, mem
from simulator.spec.model_spec import MLASpec, ModelSpec
from simulator.spec.stack import StackSpec, default_stack
from simulator.system.attention_kernels import AttentionCall


def mla_linears(spec: ModelSpec, mla: MLASpec, tp: int) -> dict[str, tuple[float, float]]:
    """The latent attention's linears on one TP rank, by name: (k, n) of each k×n weight.
    The down-projections are replicated, the up-projections and the out-proj split by
    heads."""
    h, heads = spec.hidden, spec.heads / tp
    q = {"q_down": (h, mla.q_lora_rank),
         "q_up": (mla.q_lora_rank, heads * mla.qk_head_dim)} if mla.q_lora_rank \
        else {"q_up": (h, heads * mla.qk_head_dim)}
    return {**q, "kv_down": (h, mla.kv_lora_rank + mla.qk_rope_head_dim),
            "kv_up": (mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
            "out_proj": (heads * mla.v_head_dim, h)}


def linear(st: StackSpec, name: str, tokens: float, k: float, n: float, dt: int,
            pass_: Pass, inputs: float) -> list[Op]:
    """One of a latent-attention layer's linears: a 16-bit GEMM, or under ``stack.fp8`` an
    FP8 GEMM with its casts (:func:`simulator.model.inventory.fp8.around`; ``inputs``
    elements cast, the local shard under sequence parallelism). Megatron-core builds
    every one as a Transformer Engine linear (``gpt_layer_specs.py``, the MLA spec), two
    separate down-projections each casting the normed input (the fused
    ``linear_qkv_down_proj`` variant would cast it once)."""
    if not fp8.on(st):
        return [gemm(name, tokens, k, n, dt)]
    g = fp8.linear(name, tokens, k, n, dt, "", pass_)
    return fp8.around(st, name, g, inputs, tokens * n, k * n, 1, pass_)


def mla_ops(spec: ModelSpec, mla: MLASpec, micro_batch: int, tp: int, dt: int,
            pass_: Pass, kernel: str = "flash2", stack: StackSpec | None = None,
            local: float | None = None) -> list[Op]:
    """The latent attention's ops on one TP rank in forward order (GEMMs, FP8 ones with
    their casts under ``stack.fp8``, and the core, one ``kernel`` call priced at the mean
    of its QK and V head dimensions, as its FLOPs count them); ``local`` tokens of the
    layer's input (the sequence-parallel shard) the down-projections' FP8 casts read."""
    st = stack or default_stack()
    tokens, heads = micro_batch * spec.seq_len, spec.heads / tp
    shard = tokens if local is None else local
    w = mla_linears(spec, mla, tp)

    def proj(name: str, inputs: float) -> list[Op]:
        return linear(st, name, tokens, *w[name], dt, pass_, inputs)

    norm = 2.0 if pass_ == "fwd" else 3.0
    if mla.q_lora_rank:
        q = [*proj("q_down", shard * spec.hidden),
             mem("q_norm", norm * tokens * mla.q_lora_rank, dt, st.norm_classes[0]),
             *proj("q_up", tokens * mla.q_lora_rank)]
    else:
        q = proj("q_up", shard * spec.hidden)
    kv = [*proj("kv_down", shard * spec.hidden),
          mem("kv_norm", norm * tokens * mla.kv_lora_rank, dt, st.norm_classes[0]),
          *proj("kv_up", tokens * mla.kv_lora_rank)]
    core = 2.0 * micro_batch * spec.seq_len**2 * heads * (mla.qk_head_dim + mla.v_head_dim)
    qk, v = heads * mla.qk_head_dim, heads * mla.v_head_dim
    call = AttentionCall(kernel, spec.seq_len, (mla.qk_head_dim + mla.v_head_dim) / 2)
    if pass_ == "fwd":  # read q, k, v; write o
        attn = Op("attn_core", "attention", core, dt * tokens * (2 * qk + 2 * v), core,
                  "attention_fwd", 1, 0.0, flash_scale(pass_), attn=call)
    else:  # read q, k, v, o, do; write dq, dk, dv
        attn = Op("attn_core", "attention", 2 * core, dt * tokens * (4 * qk + 4 * v),
                  2 * core, "attention_bwd", FLASH_BWD_KERNELS.get(kernel, 3), 0.0,
                  flash_scale(pass_), attn=call)
    return [*q, *kv, attn, *proj("out_proj", tokens * v)]

"""torchtitan's mixture-of-experts model-args tables -> ModelSpec fields.

``model.name = "deepseek_v3"``: the flavors of torchtitan/models/deepseek_v3/__init__.py
``deepseekv3_args`` (commit a33d0e3, January 2026), each a ``DeepSeekV3ModelArgs``
with its ``MoEArgs``: multi-head latent attention, ``n_dense_layers`` dense layers then
MoE layers of ``num_experts`` routed experts (``moe_inter_dim`` wide, ``top_k`` per
token) and ``num_shared_experts`` shared ones, RMSNorm, SwiGLU, RoPE on the
``qk_rope_head_dim`` part, untied embeddings. With ``expert_parallel_degree`` > 1 and
FSDP its ``parallelize_deepseekv3`` shards the routed experts over the mesh left after
EP (:mod:`simulator.strategies.zero3.experts`); the degrees map as for llama3.
"""

from __future__ import annotations

from typing import Any

#: flavor -> (vocab_size, dim, inter_dim, moe_inter_dim, n_layers, n_dense_layers,
#: n_heads, num_experts, num_shared_experts, top_k, score_func, q_lora_rank, flex):
#: deepseekv3_args; every flavor has kv_lora_rank 512, qk_nope_head_dim 128,
#: qk_rope_head_dim 64, v_head_dim 128; flex: attn_type "flex" with a block-causal mask
DEEPSEEK_V3 = {
    "debugmodel": (2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, "softmax", 0, False),
    "16B": (102400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, "softmax", 0, True),
    "236B": (102400, 5120, 12288, 1536, 60, 1, 128, 160, 2, 6, "softmax", 1536, True),
    "671B": (129280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, "sigmoid", 1536, True),
}


def deepseek_v3_fields(flavor: str, seq_len: int) -> dict[str, Any]:
    """The ModelSpec fields of a deepseek_v3 flavor."""
    vocab, dim, inter, moe_inter, layers, dense, heads, experts, shared, top_k, score, \
        q_rank, _ = DEEPSEEK_V3[flavor]
    return {"layers": layers, "hidden": dim, "heads": heads, "kv_heads": heads,
            "ffn_hidden": inter, "vocab": vocab, "seq_len": seq_len,
            "activation": "swiglu", "norm": "rmsnorm", "bias": False,
            "tied_embeddings": False, "position": "rope",
            "mla": {"q_lora_rank": q_rank, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128},
            "experts": experts, "experts_per_token": top_k, "expert_ffn_hidden": moe_inter,
            "shared_experts": shared, "first_dense_layers": dense, "moe_layer_freq": 1,
            "router": score}


def flex_attention(flavor: str) -> bool:
    """Whether the flavor runs flex attention with a block-causal mask."""
    return DEEPSEEK_V3[flavor][-1]

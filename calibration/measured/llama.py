"""The Llama parts of the measured-run model (``arch: llama`` in its sizes).

What a Llama 3 block differs from GPT-2's in (Meta's reference ``llama/model.py``, the
Hugging Face ``LlamaForCausalLM``): RMSNorm before attention and MLP, rotary position
embeddings on the queries and keys (no position table), grouped-query attention
(``kv_heads`` key-value heads shared by ``heads / kv_heads`` query heads each), a SwiGLU
MLP (``down(silu(gate(x)) * up(x))``) and no biases. The module names stay those of
:mod:`calibration.measured.gpt` (``ln1``, ``attn.q`` … ``mlp.down``, plus ``mlp.gate``)
so that the TP plan and FSDP2's per-block wrapping apply unchanged.

The simulator's ``model:`` block for it: ``{activation: swiglu, norm: rmsnorm, bias:
false, position: rope, kv_heads: …}`` (:mod:`calibration.measured.measure_scenario`).
Import this module only where torch is installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn

#: Llama 3's rotary base (params.json ``rope_theta``: 500000.0)
ROPE_THETA = 500_000.0
#: Llama 3's RMSNorm epsilon (params.json ``norm_eps``)
NORM_EPS = 1e-5


def rms_norm(hidden: int) -> nn.Module:
    """RMSNorm over the last dimension with a learned scale (``torch.nn.RMSNorm``)."""
    return nn.RMSNorm(hidden, eps=NORM_EPS)


def rotary_tables(seq_len: int, head_dim: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``seq_len × head_dim``, of the rotation every position applies
    to each pair of a head's dimensions (frequencies ``theta^(-2i/head_dim)``)."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch × heads × seq × head_dim) by the tables, in the half-split
    layout of Hugging Face's ``apply_rotary_pos_emb`` (``rotate_half``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of batch × heads × seq × head_dim queries over fewer key-value
    heads: SDPA's own grouped-query path (``enable_gqa``) where there are fewer."""
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) · up(x))``, no biases."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

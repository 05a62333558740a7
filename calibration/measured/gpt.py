"""A small GPT-2 style model for measured runs, laid out for Megatron-style TP (or,
with ``arch: llama`` in its sizes, Llama's block: :mod:`calibration.measured.llama`).

The model is what ``clustersim measure`` trains on synthetic tokens so that a
real step time can be put beside the simulation of the same scenario
(``model: {activation: gelu, norm: layernorm, bias: true, tied_embeddings:
true, position: learned}``).

Layout choices, all made so that PyTorch's own parallel APIs apply unchanged:

* Separate ``q``/``k``/``v`` projections, ``out`` projection, ``up``/``down``
  MLP: ``ColwiseParallel`` on q, k, v, up and ``RowwiseParallel`` on out, down
  is exactly the Megatron pattern (one all-reduce per attention and per MLP in
  forward, one each in backward).  Attention reshapes with ``-1`` heads, so the
  same code runs on the ``heads / tp`` local heads of a TP rank.
* Layers live in a ``ModuleDict`` keyed by their global index: a pipeline stage
  keeps its slice of layers (``keep_stage_modules``) and parameter names stay
  the same on every stage, as in torchtitan.
* The embedding is one module (token + learned position) so that under
  sequence parallelism its replicated output can be cut along the sequence
  without knowing the TP rank; the output head reuses the token embedding
  weight (tied) and is dropped on stages that do not own it.

Nothing here touches torch.distributed; :mod:`calibration.measured.parallel_worker`
applies the parallelism.  Import this module only where torch is installed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn

from calibration.measured import llama
from calibration.measured.gpt_presets import ARCHES, PRESETS, TINY_GPT

__all__ = [
    "GPT",
    "PRESETS",
    "TINY_GPT",
    "GPTConfig",
    "keep_stage_modules",
    "loss_fn",
    "synthetic_batch",
]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model; field names match the simulator's ``model:`` block."""

    layers: int = 4  # transformer blocks
    hidden: int = 128  # model width (d_model)
    heads: int = 4  # attention heads
    ffn_hidden: int = 512  # MLP inner width
    vocab: int = 512  # vocabulary size
    seq_len: int = 64  # tokens per sample (also the position-table length)
    kv_heads: int = 0  # key-value heads (grouped-query attention); 0: as many as heads
    arch: str = "gpt"  # gpt: GPT-2's block; llama: Llama's (calibration/measured/llama.py)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "arch" and (not isinstance(value, int) or value < (name != "kv_heads")):
                raise ValueError(f"model.{name}={value!r}: must be a positive integer")
        if self.arch not in ARCHES:
            raise ValueError(f"model.arch={self.arch!r}: choose one of {', '.join(ARCHES)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}; "
                "pick hidden as a multiple of heads"
            )
        if self.heads % self.kv:
            raise ValueError(f"model.kv_heads={self.kv_heads} does not divide model.heads="
                             f"{self.heads}; use a divisor of heads")
        if self.kv != self.heads and self.arch != "llama":
            raise ValueError(f"model.kv_heads={self.kv_heads}: grouped-query attention is "
                             "Llama's block; set arch: llama or kv_heads equal to heads")

    @property
    def kv(self) -> int:
        """Key-value heads: ``kv_heads``, or ``heads`` where it is 0."""
        return self.kv_heads or self.heads

    @property
    def is_llama(self) -> bool:
        return self.arch == "llama"

    @classmethod
    def from_dict(cls, sizes: dict[str, Any]) -> GPTConfig:
        unknown = set(sizes) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"model: unknown key(s) {sorted(unknown)}; allowed: "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        return cls(**sizes)

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


class Embedding(nn.Module):
    """Token embedding plus learned position embedding (none under rotary positions)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = None if cfg.is_llama else nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pos is None:
            return self.tok(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v for column-parallel TP; under Llama's
    block rotary positions on q and k, ``kv_heads`` key-value heads and no biases."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.rotary = cfg.is_llama
        bias, kv_width = not cfg.is_llama, cfg.kv * self.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.k = nn.Linear(cfg.hidden, kv_width, bias=bias)
        self.v = nn.Linear(cfg.hidden, kv_width, bias=bias)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: under TP each rank holds heads / tp (kv_heads / tp) of them.
        shape = (batch, seq, -1, self.head_dim)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        if self.rotary:
            cos, sin = self._rotary(seq, x.device)
            q, k = llama.apply_rotary(q, cos, sin), llama.apply_rotary(k, cos, sin)
        y = llama.attend(q, k, v)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))

    def _rotary(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables, computed once per length and device (no kernels per step)."""
        key = (seq, device)
        if key not in self._tables:
            self._tables[key] = llama.rotary_tables(seq, self.head_dim, device)
        return self._tables[key]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def norm(cfg: GPTConfig) -> nn.Module:
    """The block's normalisation: LayerNorm (GPT-2) or RMSNorm (Llama)."""
    return llama.rms_norm(cfg.hidden) if cfg.is_llama else nn.LayerNorm(cfg.hidden)


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2's, or Llama's under ``arch: llama``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = norm(cfg)
        self.mlp: nn.Module = (llama.SwiGLU(cfg.hidden, cfg.ffn_hidden) if cfg.is_llama
                               else MLP(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2: embeddings, ``layers`` blocks, final LayerNorm, tied output head (under
    ``arch: llama`` Llama's blocks and a final RMSNorm, the head still tied, as Llama
    3.2 1B and 3B tie it).

    On a pipeline stage ``embed``, ``norm`` and ``head`` may be ``None``; the
    forward then takes hidden states in and/or gives hidden states out.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: Embedding | None = Embedding(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.Module | None = norm(cfg)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.tie_weights()
        self.apply(_init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("attn.out.weight", "mlp.down.weight")):
                # GPT-2's scaled init of the residual projections.
                nn.init.normal_(param, 0.0, 0.02 / math.sqrt(2 * cfg.layers))

    def tie_weights(self) -> None:
        """Share the token-embedding matrix with the output head (both ``vocab x hidden``)."""
        if self.embed is not None and self.head is not None:
            self.head.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, 0.02)


def stage_layer_ranges(layers: int, stages: int) -> list[range]:
    """Split ``layers`` blocks evenly over ``stages`` pipeline stages, in order."""
    if stages < 1 or layers % stages:
        raise ValueError(
            f"model.layers={layers} is not divisible by the number of pipeline stages "
            f"({stages}); choose layers as a multiple of pp * virtual_stages"
        )
    per = layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def keep_stage_modules(model: GPT, stage: int, stages: int) -> GPT:
    """Turn the full ``model`` into pipeline stage ``stage`` of ``stages`` in place.

    The first stage keeps the embedding, the last keeps the final norm and the
    head; a last stage without the embedding keeps its own copy of the tied
    weight (the worker keeps the copies equal by summing their gradients).
    """
    owned = stage_layer_ranges(model.cfg.layers, stages)[stage]
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    if stage != 0:
        model.embed = None
    if stage != stages - 1:
        model.norm = None
        model.head = None
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def synthetic_batch(
    cfg: GPTConfig, batch: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens ``(inputs, next-token targets)``, each ``batch x seq_len``.

    Drawn from a private seeded ``torch.Generator`` (never the global RNG) so
    every rank that must see the same data (TP peers, pipeline stages of one
    replica) draws it from the same seed.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=gen)
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

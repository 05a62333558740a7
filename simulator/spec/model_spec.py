"""The model section: a decoder-only transformer, dense or a mixture of experts, with
latent attention optionally, and the bundled model presets it may start from.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from simulator.loading import PRESETS_DIR, read_yaml
from simulator.spec.base import MAX_SIZE, Frozen

MODELS_DIR = PRESETS_DIR / "models"


class MLASpec(Frozen):
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through
    low-rank latents; each head's query/key is a no-position part plus a RoPE part."""

    q_lora_rank: int = Field(ge=0, le=MAX_SIZE)
    """Rank of the query latent; 0 = a full-rank query projection."""
    kv_lora_rank: int = Field(gt=0, le=MAX_SIZE)
    """Rank of the key/value latent shared by the heads."""
    qk_nope_head_dim: int = Field(gt=0, le=MAX_SIZE)
    """Per-head query/key width without RoPE."""
    qk_rope_head_dim: int = Field(gt=0, le=MAX_SIZE)
    """RoPE width of a head's query/key (the key part is shared by the heads)."""
    v_head_dim: int = Field(gt=0, le=MAX_SIZE)
    """Per-head value width."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class RouterSkewSpec(Frozen):
    """Uneven expert loads (:mod:`simulator.strategies.expert.layer`): each MoE layer's share of
    the routed tokens per expert is one draw from a symmetric Dirichlet distribution of
    ``concentration`` (small: a few experts take most tokens; large: near balanced),
    from a generator seeded with ``seed``. The most loaded expert-parallel rank sets the
    pace of the all-to-all and of the expert GEMMs."""

    distribution: Literal["dirichlet"] = "dirichlet"
    """The distribution of the experts' shares of the tokens (a symmetric Dirichlet)."""
    concentration: float = Field(default=1.0, ge=1e-3, le=1e6)
    """Dirichlet α per expert: small, a few experts take most tokens; large, near
    balanced."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Seed of the draw (the same draw for every MoE layer)."""


class ModelSpec(Frozen):
    """A decoder-only transformer. Defaults describe a GPT (Megatron) block.

    A mixture of experts replaces the MLP of its MoE layers by ``experts`` routed
    experts (``experts_per_token`` of them per token) plus ``shared_experts`` that
    every token passes through, each an MLP of width ``expert_ffn_hidden``. Layer i
    is a MoE layer when i >= first_dense_layers and (i - first_dense_layers) is a
    multiple of moe_layer_freq; the other layers keep the dense MLP of ffn_hidden.
    """

    preset: str | None = None
    """A bundled model preset (``clustersim presets``) these fields start from; fields
    given beside it override the preset's."""
    layers: int = Field(gt=0, le=MAX_SIZE)
    """Transformer layers (l)."""
    hidden: int = Field(gt=0, le=MAX_SIZE)
    """Hidden size (h)."""
    heads: int = Field(gt=0, le=MAX_SIZE)
    """Query attention heads (a)."""
    kv_heads: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """Key/value heads: grouped-query attention when fewer than heads; default heads."""
    head_dim: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """Width of each query, key and value head (Megatron-LM --kv-channels, Hugging Face
    head_dim); default hidden / heads. Set it where heads × head_dim is not hidden
    (Qwen3-32B: 64 heads of 128 over a hidden size of 5120)."""
    ffn_hidden: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """Width of the MLP's inner layer; default 4 × hidden."""
    vocab: int = Field(gt=0, le=MAX_SIZE)
    """Vocabulary size (V)."""
    seq_len: int = Field(gt=0, le=MAX_SIZE)
    """Sequence length in tokens (s)."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP activation: gelu (two MLP matrices) or swiglu (three)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalisation: layernorm (weight and bias) or rmsnorm (weight only)."""
    bias: bool = True
    """Linear layers carry biases (GPT) or not (LLaMA)."""
    tied_embeddings: bool = True
    """The output projection shares the input embedding's matrix."""
    position: Literal["learned", "rope"] = "learned"
    """Position encoding: learned (adds s × h parameters) or rope (rotary, none)."""
    mla: MLASpec | None = None
    """Multi-head latent attention (DeepSeek-V2/V3) instead of (grouped-query)
    attention; none by default."""
    experts: int = Field(default=0, ge=0, le=MAX_SIZE)
    """Routed experts per MoE layer (E); 0 is a dense model."""
    experts_per_token: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Experts each token is routed to (top-k)."""
    expert_ffn_hidden: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """Width of one expert's MLP; default ffn_hidden."""
    shared_experts: int = Field(default=0, ge=0, le=MAX_SIZE)
    """Experts every token passes through, beside the routed ones."""
    first_dense_layers: int = Field(default=0, ge=0, le=MAX_SIZE)
    """Leading layers that keep the dense MLP."""
    moe_layer_freq: int = Field(default=1, gt=0, le=MAX_SIZE)
    """After the dense layers, every k-th layer is a MoE layer."""
    capacity_factor: float | None = Field(default=None, ge=0.01, le=1e4)
    """null: dropless (every routed token is computed); c: each expert computes a fixed
    buffer of c · k · tokens / experts, padded when short, tokens beyond it dropped."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """softmax top-k (Mixtral) or sigmoid top-k with a per-expert bias (DeepSeek-V3)."""
    router_skew: RouterSkewSpec | None = None
    """Uneven expert loads drawn from a Dirichlet; null: every expert receives the same
    number of tokens."""
    mtp_layers: int = Field(default=0, ge=0, le=MAX_SIZE)
    """Multi-token prediction modules (DeepSeek-V3 §2.2, D; Megatron-LM --mtp-num-layers):
    each predicts one more future token from the previous depth's hidden states and the
    shifted tokens' embedding through two norms, a 2h → h projection, one transformer
    layer of the last layer's kind and a final norm, then the shared output layer and a
    cross-entropy. All sit on the pipeline stage of the output layer; 0: none."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("preset") is not None:
            data = {**_preset_fields(data["preset"]), **data}
        if isinstance(data.get("heads"), int) and data.get("kv_heads") is None:
            data = {**data, "kv_heads": data["heads"]}
        hidden, heads = data.get("hidden"), data.get("heads")
        if data.get("head_dim") is None and isinstance(hidden, int) \
                and isinstance(heads, int) and heads > 0 \
                and (hidden % heads == 0 or data.get("mla") is not None):
            data = {**data, "head_dim": max(hidden // heads, 1)}
        if isinstance(data.get("hidden"), int) and data.get("ffn_hidden") is None:
            data = {**data, "ffn_hidden": 4 * data["hidden"]}
        if data.get("expert_ffn_hidden") is None and isinstance(data.get("ffn_hidden"), int):
            data = {**data, "expert_ffn_hidden": data["ffn_hidden"]}
        return data

    @property
    def kv(self) -> int:
        assert self.kv_heads is not None
        return self.kv_heads

    @property
    def ffn(self) -> int:
        assert self.ffn_hidden is not None
        return self.ffn_hidden

    @property
    def head_size(self) -> int:
        """Each head's width (``head_dim``, resolved to hidden / heads when not set)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def q_width(self) -> int:
        """The attention's inner width, heads x head_dim: what the query projection
        writes and the output projection reads (hidden unless head_dim is set apart)."""
        return self.heads * self.head_size

    @property
    def expert_ffn(self) -> int:
        assert self.expert_ffn_hidden is not None
        return self.expert_ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has routed experts instead of the dense MLP.
        Layers ``layers`` .. ``layers + mtp_layers - 1`` are the multi-token prediction
        modules' and take the last layer's kind (Megatron-LM builds them from the last
        layer's spec, and counts them so in ``num_floating_point_operations``)."""
        layer = min(layer, self.layers - 1)
        if not self.is_moe or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers) % self.moe_layer_freq == 0

    @property
    def head_needs_embedding(self) -> bool:
        """Whether the output layer's stage uses the word embedding: as the tied output
        projection, or as the multi-token prediction modules' input embedding (Megatron-LM
        keeps a copy there when that stage is not the first, ``LanguageModule.
        setup_embeddings_and_output_layer``, and all-reduces its gradient with the first
        stage's, ``_allreduce_word_embedding_grads``)."""
        return self.tied_embeddings or self.mtp_layers > 0

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers."""
        after = self.layers - self.first_dense_layers
        if not self.is_moe or after <= 0:
            return 0
        return -(-after // self.moe_layer_freq)


def _preset_fields(name: object) -> dict[str, Any]:
    if not isinstance(name, str) or not (MODELS_DIR / f"{name}.yaml").exists():
        near = difflib.get_close_matches(str(name), preset_model_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown model preset; {hint}bundled: {', '.join(preset_model_names())}")
    base = read_yaml(MODELS_DIR / f"{name}.yaml", "model.preset")
    assert isinstance(base, dict), f"preset {name} is not a mapping"
    return base


def preset_model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_preset_model(name: str) -> ModelSpec:
    return ModelSpec.model_validate({"preset": name})

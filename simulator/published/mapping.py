"""A published row as a scenario: which stack, system, model, layout, batch and dtype it
ran, or why the simulator cannot say it.

- **Framework → stack preset and model family** (:data:`FRAMEWORKS`, matched by words of
  the ``framework`` column): the stack the framework runs (a preset with its sources)
  and the architecture its models have where the table does not say it (activation,
  norm, biases, tied embeddings, positions), each from the framework's model code.
- **GPU → system preset**: the one device-name table
  (:func:`simulator.system.devices.preset_for`), eight GPUs a node as the presets have
  them (fewer GPUs: one node of that many).
- **Layout**: tp, pp (with ``vpp`` virtual stages: interleaved 1F1B), cp, ep, dp (the
  GPUs left when blank); ``zero_or_fsdp`` as a ZeRO stage (FSDP FULL_SHARD is ZeRO-3,
  SHARD_GRAD_OP ZeRO-3 kept gathered from forward to backward: :func:`reshard_of`,
  HYBRID_SHARD ZeRO-3 sharded within a node: :func:`dp_shard_of`;
  _HYBRID_SHARD_ZERO2 is not modelled); ``recompute`` (full, selective or
  none); the mixed-precision mode of FSDP (PURE reduces the gradients in the training
  dtype) as stack overrides.
- **Model**: the row's dimensions over the framework's architecture; a head width
  apart from hidden / heads (Qwen3, GPT-OSS) from ``other_flags`` (:data:`HEAD_DIM`).
- **Attention kernel**: the framework's name for it stated in ``other_flags``
  (``attn_impl triton``, llm-foundry's; :func:`attention_of`) as the stack's
  ``attention``; none stated: the stack preset's own.
- **Batch and dtype**: the global batch in sequences, the micro-batch, bf16/fp16/fp32
  (autocast ``amp_`` or not); fp8 is not modelled yet.

Every refusal is a reason in words; :mod:`simulator.published.compare` lists those rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from simulator.published.rows import Row
from simulator.system.devices import preset_for


class Unexpressed(Exception):  # noqa: N818 (a reason, not a failure of the program)
    """A row the simulator cannot express; the message says why."""


@dataclass(frozen=True)
class Framework:
    """What a framework's rows run: its stack preset, stack overrides by FSDP's
    mixed-precision mode, and its models' architecture where the table is silent."""

    stack: str
    model: dict[str, Any] = field(default_factory=dict)
    precision_modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the framework's attention implementations by the name its config gives them
    attn_impls: dict[str, str] = field(default_factory=dict)


#: (words the ``framework`` column holds, what its rows run), most specific first
FRAMEWORKS: tuple[tuple[tuple[str, ...], Framework], ...] = (
    # llm-foundry's MPT (llmfoundry/models/mpt/configuration_mpt.py defaults and the
    # benchmark yamls scripts/train/yamls/pretrain/mpt-*.yaml): exact-GELU MLP
    # (expansion_ratio 4), no_bias: false (biases everywhere: the tables' NumParams count
    # them), LayerNorm (low_precision_layernorm), tied embeddings (modeling_mpt.py refuses
    # untied ones; logits are wte's transpose), learned positions (learned_pos_emb true,
    # alibi false: NumParams grow with seq_len). FSDP's mixed-precision mode PURE reduces
    # the gradients in bf16 (composer mosaic_fsdp_utils.py; accumulation stays fp32).
    (("llm-foundry",), Framework(
        "composer-fsdp1",
        {"activation": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True,
         "position": "learned"},
        {"PURE": {"grad_reduce_dtype": "param"}},
        # llmfoundry/models/layers/attention.py attn_impl: flash (flash-attn's
        # flash_attn_func: 1.x under the ``gpu`` extra, 2.x under ``gpu-flash2``), triton
        # (llmfoundry/models/layers/flash_attn_triton.py, flash-attn's Triton kernel) or
        # torch (scaled_multihead_dot_product_attention: matmul, softmax, matmul)
        {"flash": "flash2", "triton": "flash_triton", "torch": "unfused"})),
    (("torchtitan",), Framework(
        "torchtitan",  # torchtitan/models/llama3/model.py: SwiGLU, RMSNorm, no biases, RoPE
        {"activation": "swiglu", "norm": "rmsnorm", "bias": False, "tied_embeddings": False,
         "position": "rope"})),
    (("megatron",), Framework(
        "megatron-core",  # megatron/core/models/gpt: GPT defaults (GELU, LayerNorm, biases)
        {"activation": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True,
         "position": "learned"})),
    (("deepspeed",), Framework(
        "deepspeed",  # Megatron-DeepSpeed's GPT
        {"activation": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True,
         "position": "learned"})),
)


def framework_of(row: Row) -> Framework:
    name = row.framework.lower()
    for words, fw in FRAMEWORKS:
        if all(w in name for w in words):
            return fw
    known = "; ".join(" ".join(w) for w, _ in FRAMEWORKS)
    raise Unexpressed(f"framework {row.framework!r} has no stack preset (known: {known})")


def zero_stage(text: str) -> int:
    """The ZeRO stage of a ``zero_or_fsdp`` cell."""
    t = text.upper()
    if "HYBRID" in t and "ZERO2" in t:
        raise Unexpressed(f"{text!r}: hybrid sharding of gradients only (ZeRO-2 within a "
                          "node) is not modelled; HYBRID_SHARD is")
    if "HYBRID" in t:
        return 3
    for words, stage in ((("FULL_SHARD",), 3), (("SHARD_GRAD_OP",), 3), (("NO_SHARD",), 0),
                         (("ZERO-3",), 3), (("ZERO3",), 3), (("ZERO-2",), 2), (("ZERO2",), 2),
                         (("ZERO-1",), 1), (("ZERO1",), 1), (("DISTRIBUTED OPTIMIZER",), 1),
                         (("FSDP",), 3)):
        if all(w in t for w in words):
            return stage
    if t.strip() in ("", "NONE", "DDP", "0"):
        return 0
    raise Unexpressed(f"zero_or_fsdp {text!r} is not a sharding the simulator knows")


def dp_shard_of(text: str, dp: int, per_node: int, model_parallel: int) -> dict[str, int]:
    """``parallel.dp_shard`` of a ``zero_or_fsdp`` cell: FSDP1's HYBRID_SHARD without a
    device mesh shards over the node's GPUs and replicates across nodes
    (torch/distributed/fsdp/_init_utils.py ``_init_intra_and_inter_node_groups``: the
    intra-node group of ``num_devices_per_node`` consecutive ranks, the inter-node group
    of the same local rank on every node), which is the whole world data-parallel;
    nothing for any other sharding."""
    if "HYBRID" not in text.upper():
        return {}
    if model_parallel > 1:
        raise Unexpressed(f"{text!r} with tp, pp or cp: FSDP1's hybrid groups are a "
                          "node's GPUs of a purely data-parallel world; the row does not "
                          "say how it shards beside model parallelism")
    return {"dp_shard": min(per_node, dp)}


def reshard_of(text: str) -> dict[str, bool]:
    """``parallel.reshard_after_forward`` of a ``zero_or_fsdp`` cell: false for FSDP's
    SHARD_GRAD_OP, which shards the parameters outside computation, "unshards before the
    forward, does not reshard them after the forward, and only reshards them after the
    backward computation" (torch/distributed/fsdp/api.py ``ShardingStrategy``): ZeRO-3
    with one gather a unit and micro-batch, not ZeRO-2's gather after the step; nothing
    for any other sharding."""
    return {"reshard_after_forward": False} if "SHARD_GRAD_OP" in text.upper() else {}


def recompute_of(text: str) -> str:
    t = text.lower().strip()
    if t in ("", "none", "no", "off"):
        return "none"
    if "full" in t:
        return "full"
    if "selective" in t:
        return "selective"
    raise Unexpressed(f"recompute {text!r}: only full, selective or none are modelled")


def dtype_of(text: str) -> str:
    """The training dtype of a ``dtype`` cell: bf16, fp16 or fp32 (``amp_`` for autocast);
    FP8 (``fp8``, ``amp_fp8``) trains in bf16 with FP8 linears (:func:`fp8_of`)."""
    t = text.lower().removeprefix("amp_")
    if t == "fp8":
        return "bf16"
    if t in ("bf16", "fp16", "fp32"):
        return t
    raise Unexpressed(f"dtype {text!r}: expected bf16, fp16, fp32 or fp8 (amp_ for autocast)")


def fp8_of(text: str) -> dict[str, Any]:
    """Stack overrides of an FP8 ``dtype`` cell: Transformer Engine's delayed scaling, the
    recipe Composer's ``amp_fp8`` enters (composer/core/precision.py: ``te.fp8_autocast``
    with a ``DelayedScaling`` recipe); how often the weights are cast is the stack's
    (``fp8_weight_cast``: every forward under Composer)."""
    if text.lower().removeprefix("amp_") != "fp8":
        return {}
    return {"fp8": "delayed"}


def precision_mode(text: str) -> str:
    """FSDP's mixed-precision mode named in a ``zero_or_fsdp`` cell (DEFAULT if none)."""
    found = re.search(r"mixed precision mode (\w+)", text, re.IGNORECASE)
    return found.group(1).upper() if found else "DEFAULT"


def _cluster(row: Row) -> dict[str, Any]:
    system = preset_for(row.gpu)
    if system is None:
        raise Unexpressed(f"gpu {row.gpu!r} has no system preset")
    per_node = 8 if row.gpus >= 8 else row.gpus
    if row.gpus % per_node:
        raise Unexpressed(f"{row.gpus} GPUs are not whole nodes of {per_node}")
    return {"system": system, "nodes": row.gpus // per_node, "gpus_per_node": per_node}


def replicas(row: Row) -> int:
    """The data-parallel replicas a row runs: its ``dp``, or the GPUs the model-parallel
    groups leave when blank."""
    return row.dp or row.gpus // ((row.tp or 1) * (row.pp or 1) * (row.cp or 1))


def _parallel(row: Row) -> dict[str, Any]:
    tp, pp, cp, ep = (row.tp or 1), (row.pp or 1), (row.cp or 1), (row.ep or 1)
    dp = replicas(row)
    vpp = row.vpp or 1
    sp = row.sequence_parallel.strip().lower()
    if sp not in ("", "false", "no", "none", "0", "true", "yes", "1"):
        raise Unexpressed(f"sequence_parallel {row.sequence_parallel!r} is not true or false")
    per_node = _cluster(row)["gpus_per_node"]
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp": dp, "virtual_stages": vpp,
            "schedule": "interleaved" if vpp > 1 else "1f1b",
            "zero": zero_stage(row.zero_or_fsdp), "recompute": recompute_of(row.recompute),
            "sequence_parallel": sp in ("true", "yes", "1"),
            **dp_shard_of(row.zero_or_fsdp, dp, per_node, tp * pp * cp),
            **reshard_of(row.zero_or_fsdp)}


#: a head width the table has no column for, stated in ``other_flags`` by either name
#: (Hugging Face ``head_dim``, Megatron-LM ``--kv-channels``): ``head_dim 128``,
#: ``head_dim=128``, ``--kv-channels 128``
HEAD_DIM = re.compile(r"(?:\bhead[_ ]dim|kv[_-]channels)\s*[=:]?\s*(\d+)", re.IGNORECASE)


def _model(row: Row, fw: Framework) -> dict[str, Any]:
    out: dict[str, Any] = {**fw.model, "layers": row.layers, "hidden": row.hidden,
                           "heads": row.heads, "vocab": row.vocab, "seq_len": row.seq_len}
    if row.kv_heads:
        out["kv_heads"] = row.kv_heads
    if row.ffn_hidden:
        out["ffn_hidden"] = row.ffn_hidden
    head_dim = HEAD_DIM.search(row.other_flags)
    if head_dim:
        out["head_dim"] = int(head_dim.group(1))
    if row.experts:
        out["experts"] = row.experts
        out["experts_per_token"] = row.topk or 1
    return out


#: the attention implementation a row states, by its framework's name for it
#: (``attn_impl triton``, ``attn_impl=flash``), and flash-attn's major version where
#: stated (``flash-attn 1.0.9``, ``flash-attn==2.4.2``)
ATTN_IMPL = re.compile(r"\battn_impl\s*[=:]?\s*(\w+)", re.IGNORECASE)
FLASH_ATTN_MAJOR = re.compile(r"\bflash[-_]attn\s*(?:==|=|\s)\s*v?(\d+)\.", re.IGNORECASE)


def attention_of(row: Row, fw: Framework) -> dict[str, Any]:
    """Stack overrides of the attention implementation ``other_flags`` states: the
    framework's kernel by that name (``flash`` under flash-attn 1.x: flash1); none
    stated, nothing (the stack preset's own)."""
    found = ATTN_IMPL.search(row.other_flags)
    if not found:
        return {}
    name = found.group(1).lower()
    if name not in fw.attn_impls:
        known = ", ".join(fw.attn_impls) or "none"
        raise Unexpressed(f"attn_impl {name!r}: not an attention implementation of "
                          f"{row.framework} the simulator knows ({known})")
    major = FLASH_ATTN_MAJOR.search(row.other_flags)
    if fw.attn_impls[name] == "flash2" and major and major.group(1) == "1":
        return {"attention": "flash1"}
    return {"attention": fw.attn_impls[name]}


def scenario_data(row: Row, method: str = "analytic") -> dict[str, Any]:
    """The scenario of ``row`` as a mapping (validated by the caller), or
    :class:`Unexpressed` with the reason."""
    fw = framework_of(row)
    stack: dict[str, Any] = {"preset": fw.stack,
                             **fw.precision_modes.get(precision_mode(row.zero_or_fsdp), {}),
                             **fp8_of(row.dtype), **attention_of(row, fw)}
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", row.name)[:200]
    return {"name": name, "description": row.source[:10_000], "model": _model(row, fw),
            "cluster": _cluster(row), "parallel": _parallel(row),
            "training": {"global_batch": row.global_batch, "micro_batch": row.micro_batch,
                         "dtype": dtype_of(row.dtype)},
            "stack": stack, "simulation": {"method": method, "fidelity": "folded"}}

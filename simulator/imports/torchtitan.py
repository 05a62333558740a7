"""torchtitan TOML job configs -> a scenario.

Input: a ``train_configs/*.toml`` as torchtitan's ``JobConfig`` reads it
(torchtitan/config/job_config.py; every key listed in ``torchtitan_keys.tsv`` with the
commit). Each key is mapped to a scenario field, ignored by design
(:data:`IGNORED`: paths, logging, checkpoints, learning rates) or listed as unmapped
with what is simulated instead; a key JobConfig does not have is listed as unknown.

Semantics, from torchtitan at that commit: ``parallelism.data_parallel_shard_degree`` -1
takes the GPUs left after the other degrees; FSDP2 shards over dp_shard (ZeRO-3),
replicate-only is DDP, both is HSDP (``parallel.dp_shard``); tensor parallelism always
runs sequence parallel on the norms (``parallelize_llama``);
``training.local_batch_size`` is per data-parallel rank, the pipeline splits it into
``pipeline_parallel_microbatch_size`` micro-batches; FSDP's ``MixedPrecisionPolicy``
computes in ``training.mixed_precision_param``; the model is ``model.name`` +
``model.flavor`` from torchtitan's model-args table (:data:`LLAMA3`,
torchtitan/models/llama3/__init__.py ``llama3_args``; ``deepseek_v3``'s in
:mod:`simulator.imports.torchtitan_moe`).
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from simulator.errors import Problem, UserError
from simulator.imports.common import Draft, layout, model_section
from simulator.imports.torchtitan_moe import DEEPSEEK_V3, deepseek_v3_fields, flex_attention
from simulator.loading import decode_text, read_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same parser as a package before Python 3.11
    import tomli as tomllib

KEYS = Path(__file__).with_name("torchtitan_keys.tsv")
TOML_LIMIT_BYTES = 1 << 20  # a train config is ~2 KB

#: flavor -> (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of), the
#: dense flavors of torchtitan/models/llama3/__init__.py (vocab_size 128256, args.py)
LLAMA3 = {"debugmodel": (256, 6, 16, None, None, 256),
          "8B": (4096, 32, 32, 8, 1.3, 1024),
          "70B": (8192, 80, 64, 8, 1.3, 4096),
          "405B": (16384, 126, 128, 8, 1.2, 4096)}
LLAMA3_VOCAB = 128256

#: Keys (or sections, by prefix) that do not bear on a simulated step, with the reason
IGNORED = {
    "job.": "paths and descriptions", "profiling.": "profiling", "metrics.": "logging",
    "checkpoint.": "checkpoint files (clustersim train models checkpoints from "
                   "checkpoint.*)",
    "comm.": "timeouts and debugging traces", "validation.": "evaluation between steps",
    "experimental.": "custom code imports", "memory_estimation.": "a dry run of the real job",
    "fault_tolerance.": "fault tolerance of the real job (clustersim train: reliability.*)",
    "debug.": "seeds and determinism", "lr_scheduler.": "learning-rate schedule",
    "optimizer.lr": "hyperparameter", "optimizer.eps": "hyperparameter",
    "optimizer.weight_decay": "hyperparameter", "model.hf_assets_path": "tokenizer files",
    "model.tokenizer_path": "tokenizer files", "model.print_after_conversion": "logging",
    "training.dataset": "data", "training.dataset_path": "data",
    "training.steps": "run length: give clustersim train --tokens",
    "training.gc_": "host garbage collection", "training.dataloader.": "data loading",
    "activation_checkpoint.preserve_rng_state": "numerics only",
    "activation_checkpoint.determinism_check": "debugging",
    "activation_checkpoint.debug": "debugging",
    "activation_checkpoint.visualize_memory_budget_pareto": "debugging",
    "compile.backend": "inductor is what the stack's fusions describe",
    "quantize.": "options of the converters, which apply only when model.converters names "
                 "them (listed there)",
}
#: Keys of older torchtitan versions, by prefix, with what the scenario does instead
LEGACY = {"float8.": "an older torchtitan's fp8 section: no fp8 GEMMs in the schema; "
                     "simulated in the training dtype"}
UNMAPPED = "no field in the scenario schema; simulated without it"
#: Keys read by the rules below
MAPPED = {
    "job.description", "model.name", "model.flavor", "model.converters",
    "training.local_batch_size",
    "training.global_batch_size", "training.seq_len", "training.max_norm", "training.dtype",
    "training.mixed_precision_param", "training.mixed_precision_reduce",
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
    "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree",
    "parallelism.expert_tensor_parallel_degree", "parallelism.fsdp_reshard_after_forward",
    "parallelism.enable_async_tensor_parallel", "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_microbatch_size",
    "parallelism.context_parallel_rotate_method", "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option", "compile.enable", "compile.components",
    "optimizer.name", "optimizer.implementation",
}
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
OPTIMIZERS = {"fused": "fused", "foreach": "foreach", "for-loop": "per_tensor",
              "fused_opt_states_bf16": "fused"}
#: optimizer.implementation values that store both AdamW moments in bf16 (torchtitan/
#: components/optimizer/optimizer.py, since #2732: "initialize Adam/AdamW momentum and
#: variance in bfloat16 via a step pre-hook", the fused kernel's mixed-precision path)
BF16_STATES = ("fused_opt_states_bf16",)


@lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    lines = KEYS.read_text(encoding="utf-8").splitlines()
    return frozenset(k for k in lines if k.strip() and not k.startswith("#"))


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file, bounded as every input is; a syntax error is one line."""
    text = decode_text(read_bytes(path, "torchtitan", TOML_LIMIT_BYTES), "torchtitan",
                       str(path))
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError([Problem("torchtitan", path.name, f"not valid TOML: {exc}")]) from None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def classify(key: str) -> tuple[str, str]:
    """(mapped | ignored | unmapped | unknown, the reason) for one dotted key."""
    if key in MAPPED:
        return "mapped", ""
    legacy = next((r for p, r in LEGACY.items() if key.startswith(p)), None)
    if legacy is not None:
        return "unmapped", legacy
    if key not in known_keys():
        return "unknown", "not a key of torchtitan's JobConfig"
    ignored = next((r for p, r in IGNORED.items() if key.startswith(p)), None)
    return ("ignored", ignored) if ignored else ("unmapped", UNMAPPED)


class Config:
    """The flattened TOML with typed getters that name the key on a bad value."""

    def __init__(self, flat: dict[str, Any]) -> None:
        self.flat = flat

    def get(self, key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        value = self.flat.get(key, default)
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in
                                               (kind if isinstance(kind, tuple) else (kind,)))
        if not ok:
            name = kind.__name__ if isinstance(kind, type) else " or ".join(
                k.__name__ for k in kind)
            raise UserError([Problem(key, value, f"expected {name}, as torchtitan's "
                                     "JobConfig declares it")])
        return value

    def choice(self, key: str, default: str, table: dict[str, Any]) -> Any:
        value = self.get(key, default, str)
        if value not in table:
            raise UserError([Problem(key, value, f"expected one of {', '.join(table)}")])
        return table[value]


def llama3_fields(flavor: str, seq_len: int) -> dict[str, Any]:
    """The ModelSpec fields of a llama3 flavor: the SwiGLU width as torchtitan's
    FeedForward computes it (2/3 of 4·dim, times ffn_dim_multiplier, rounded up to
    multiple_of)."""
    dim, layers, heads, kv, mult, multiple = LLAMA3[flavor]
    hidden = int(2 * (4 * dim) / 3)
    if mult is not None:
        hidden = int(mult * hidden)
    hidden = multiple * ((hidden + multiple - 1) // multiple)
    return {"layers": layers, "hidden": dim, "heads": heads, "kv_heads": kv or heads,
            "ffn_hidden": hidden, "vocab": LLAMA3_VOCAB, "seq_len": seq_len,
            "activation": "swiglu", "norm": "rmsnorm", "bias": False,
            "tied_embeddings": False, "position": "rope"}


def model(c: Config, d: Draft) -> None:
    name = c.get("model.name", "llama3", str)
    if name == "deepseek_v3":
        deepseek_v3(c, d)
        return
    if name != "llama3":
        raise UserError([Problem("model.name", name, "no model-args table for it here; "
                                 "supported: llama3, deepseek_v3")])
    flavor = c.get("model.flavor", "debugmodel", str)
    if flavor not in LLAMA3:
        raise UserError([Problem("model.flavor", flavor, "expected one of "
                                 f"{', '.join(LLAMA3)} (flex/varlen attention flavors "
                                 "are not simulated)")])
    d.set("model", llama3_fields(flavor, c.get("training.seq_len", 2048, int)))
    converters = c.get("model.converters", [], list)
    if converters:
        d.note("model.converters", converters, "no fp8/mx GEMMs in the schema; "
               "simulated in the training dtype")


def deepseek_v3(c: Config, d: Draft) -> None:
    """A deepseek_v3 flavor (:mod:`simulator.imports.torchtitan_moe`)."""
    flavor = c.choice("model.flavor", "debugmodel", {f: f for f in DEEPSEEK_V3})
    d.set("model", deepseek_v3_fields(flavor, c.get("training.seq_len", 2048, int)))
    if flex_attention(flavor):
        d.note("model.flavor", flavor, "flex attention with a block-causal mask: simulated "
               "as causal attention over the whole sequence")


def degrees(c: Config, d: Draft) -> None:
    for key, field in (("tensor_parallel_degree", "tp"), ("pipeline_parallel_degree", "pp"),
                       ("context_parallel_degree", "cp"), ("expert_parallel_degree", "ep")):
        value = c.get(f"parallelism.{key}", 1, int)
        if value < 1:
            raise UserError([Problem(f"parallelism.{key}", value, "expected a whole number "
                                     ">= 1")])
        d.set(f"parallel.{field}", value)
    if d.get("parallel.ep") > 1:
        d.set("parallel.expert_tp", c.get("parallelism.expert_tensor_parallel_degree", 1, int))
    d.set("parallel.sequence_parallel", d.get("parallel.tp") > 1)
    if c.get("parallelism.enable_async_tensor_parallel", False, bool):
        d.set("stack.tp_overlap", "pipelined")
    if d.get("parallel.pp") > 1:
        d.set("parallel.schedule", c.choice("parallelism.pipeline_parallel_schedule", "1F1B",
                                            SCHEDULES))
    if d.get("parallel.cp") > 1:
        # torch/distributed/tensor/experimental/_attention.py: _AllGatherRotater gathers
        # every rank's K/V once; _AllToAllRotater "send[s] the kv to the next rank" each
        # ring step (permute_tensor to rank + 1), issued before the step's attention: the
        # ring of point-to-point exchanges Megatron calls p2p
        rotate = c.get("parallelism.context_parallel_rotate_method", "allgather", str)
        c_type = {"allgather": "allgather", "alltoall": "p2p"}.get(rotate)
        if c_type is None:
            d.note("parallelism.context_parallel_rotate_method", rotate, "torchtitan's "
                   "rotate methods are allgather and alltoall; simulated as allgather")
            c_type = "allgather"
        d.set("parallel.cp_comm_type", c_type)


def data_parallel(c: Config, d: Draft, gpus: int) -> None:
    """dp = replicate · shard (shard -1: what the other degrees leave); FSDP (ZeRO-3)
    when sharded, DDP when only replicated; both: HSDP, ``parallel.dp_shard`` = shard
    (torchtitan's mesh (dp_replicate, dp_shard, cp, tp): FSDP2 shards over dp_shard · cp
    and all-reduces across dp_replicate)."""
    replicate = c.get("parallelism.data_parallel_replicate_degree", 1, int)
    shard = c.get("parallelism.data_parallel_shard_degree", -1, int)
    rest = gpus // (d.get("parallel.tp") * d.get("parallel.cp") * d.get("parallel.pp"))
    if shard == -1:
        if rest % replicate:
            raise UserError([Problem("parallelism.data_parallel_replicate_degree", replicate,
                                     f"does not divide the {rest} data-parallel ranks")])
        shard = rest // replicate
    if replicate * shard != rest:
        raise UserError([Problem("parallelism", f"dp_replicate({replicate}) * dp_shard("
                                 f"{shard}) = {replicate * shard}", f"must be the {rest} "
                                 "ranks left by tp · cp · pp; fix the degrees or "
                                 "--nodes/--gpus")])
    d.set("parallel.zero", 3 if shard > 1 or d.get("parallel.cp") > 1 else 0)
    if replicate > 1 and d.get("parallel.zero") == 3:  # HSDP: FSDP2 on (replicate, shard)
        d.set("parallel.dp_shard", shard)
    policy = c.get("parallelism.fsdp_reshard_after_forward", "default", str)
    if d.get("parallel.zero") == 3:
        table = {"default": d.get("parallel.pp") == 1, "always": True, "never": False}
        if policy not in table:
            raise UserError([Problem("parallelism.fsdp_reshard_after_forward", policy,
                                     "expected default, always or never")])
        d.set("parallel.reshard_after_forward", table[policy])


def batch(c: Config, d: Draft) -> None:
    local = c.get("training.local_batch_size", 8, int)
    micro = c.get("parallelism.pipeline_parallel_microbatch_size", 1, int)
    if local < 1 or micro < 1:
        raise UserError([Problem("training.local_batch_size", local, "expected >= 1")])
    d.set("training.micro_batch", micro if d.get("parallel.pp") > 1 else local)
    total = c.get("training.global_batch_size", -1, int)
    d.set("training.global_batch", total if total > 0 else local * d.get("parallel.dp"))


def precision(c: Config, d: Draft) -> None:
    fsdp = d.get("parallel.zero") == 3
    key = "training.mixed_precision_param" if fsdp else "training.dtype"
    dtypes = {"bfloat16": "bf16", "float32": "fp32"}
    d.set("training.dtype", c.choice(key, "bfloat16" if fsdp else "float32", dtypes))
    c.choice("training.mixed_precision_reduce", "float32", {"float32": "fp32"})
    d.set("stack.grad_clip", c.get("training.max_norm", 1.0, (int, float)) > 0)
    name = c.get("optimizer.name", "AdamW", str)
    if name not in ("AdamW", "Adam"):
        d.note("optimizer.name", name, "the schema's optimizer is AdamW")
    d.set("stack.optimizer", c.choice("optimizer.implementation", "fused", OPTIMIZERS))
    if c.get("optimizer.implementation", "fused", str) in BF16_STATES:
        d.set("stack.exp_avg_dtype", "bf16")
        d.set("stack.exp_avg_sq_dtype", "bf16")


def checkpointing(c: Config, d: Draft) -> None:
    mode = c.get("activation_checkpoint.mode", "selective", str)
    option = str(c.get("activation_checkpoint.selective_ac_option", "2", (str, int)))
    if mode in ("none", "full"):
        d.set("parallel.recompute", mode)
    elif mode == "selective" and option == "op":  # _get_custom_policy's save list
        d.set("parallel.recompute", "op")
    elif mode == "selective" and option.isdigit() and int(option) >= 1:
        d.set("parallel.recompute", "full")
        if option != "1":  # every k-th block of the rank (_apply_ac_to_transformer_block)
            d.set("parallel.recompute_every", int(option))
    elif mode == "memory_budget":
        d.set("parallel.recompute", "none")
        d.note("activation_checkpoint.mode", mode, "no field for a memory budget; "
               "simulated without recomputation")
    else:
        raise UserError([Problem("activation_checkpoint.mode", f"{mode} ({option})",
                                 "expected none, full, selective (with op or a layer "
                                 "count) or memory_budget")])


def compiled(c: Config, d: Draft) -> None:
    """torch.compile's fusions (the torchtitan stack preset lists what it fuses):
    none without ``compile.enable``, the loss's only when ``loss`` is a component; the
    model's norms are PyTorch's own ``nn.RMSNorm`` kernels unless the model is compiled."""
    components = c.get("compile.components", ["model", "loss"], list)
    fusions: list[str] = []
    model = c.get("compile.enable", False, bool) and "model" in components
    if model:
        fusions += ["bias_act", "bias_dropout_add", "rope"]
    if c.get("compile.enable", False, bool) and "loss" in components:
        fusions.append("cross_entropy")
    d.set("stack.fusions", fusions)
    d.set("stack.norm_kernel", "fused" if model else "torch")


def import_torchtitan(path: Path, system: str, nodes: int | None, gpus: int | None,
                      stack: str, name: str) -> Draft:
    """The draft scenario of one TOML config (validated by the caller)."""
    from simulator.system.profiles import load_system

    flat = flatten(read_toml(path))
    c = Config(flat)
    d = Draft()
    d.set("name", name)
    d.set("stack", {"preset": stack})
    if "job.description" in flat:
        d.set("description", c.get("job.description", "", str))
    model(c, d)
    degrees(c, d)
    layout(d, system, nodes, gpus, "torchtitan")
    total = d.get("cluster.nodes") * (d.get("cluster.gpus_per_node")
                                      or load_system(system).gpus_per_node)
    data_parallel(c, d, total)
    batch(c, d)
    precision(c, d)
    checkpointing(c, d)
    compiled(c, d)
    d.set("model", model_section(d.data["model"]))
    for key, value in flat.items():
        kind, reason = classify(key)
        if kind in ("unmapped", "unknown"):
            d.note(key, _text(value), reason)
    return d


def _text(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)

"""How Megatron-LM's launch arguments become scenario fields: one small rule per concept.

Each :class:`Rule` names the flags it reads and fills the draft from them, with
Megatron-LM's own defaults where a flag is absent (megatron/training/arguments.py at
the commit :mod:`simulator.imports.megatron` names: the flags' defaults and
``validate_args``, e.g. ``ffn_hidden_size`` 4h, or int(8h/3 / 64) · 64 with
``--swiglu``; ``kv_channels`` h / heads; ``--recompute-activations`` is selective
recomputation). A flag that a rule reads but cannot express is a note with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from simulator.errors import Problem, UserError
from simulator.imports.common import Draft
from simulator.imports.megatron_optimizer import DTYPES, FLAG, optimizer_states
from simulator.spec.scenario import RecomputeModule


class Parsed:
    """The launch arguments: option -> its values (``[]`` for a switch), each option
    under its first spelling (``--no-x`` and ``--disable-x`` are one)."""

    def __init__(self, values: dict[str, list[str]]) -> None:
        self.values = values

    def given(self, flag: str) -> bool:
        return flag in self.values

    def text(self, flag: str, default: str | None = None) -> str | None:
        vals = self.values.get(flag)
        if vals is None:
            return default
        if len(vals) != 1:
            raise UserError([Problem(flag, " ".join(vals), "takes one value")])
        return vals[0]

    def texts(self, flag: str) -> list[str]:
        return self.values.get(flag, [])

    def number(self, flag: str, default: Any = None, kind: type = int) -> Any:
        raw = self.text(flag)
        if raw is None:
            return default
        try:
            value = kind(raw)
        except ValueError:
            word = "a whole number" if kind is int else "a number"
            raise UserError([Problem(flag, raw, f"expected {word}, as Megatron-LM's parser "
                                     "does")]) from None
        if kind is int and value < 0:
            raise UserError([Problem(flag, raw, "expected a whole number >= 0")])
        return value


@dataclass(frozen=True)
class Rule:
    flags: tuple[str, ...]
    apply: Callable[[Parsed, Draft], None]


def degrees(a: Parsed, d: Draft) -> None:
    d.set("parallel.tp", a.number("--tensor-model-parallel-size", 1))
    d.set("parallel.pp", a.number("--pipeline-model-parallel-size", 1))
    for flag, key in (("--context-parallel-size", "cp"), ("--expert-model-parallel-size", "ep"),
                      ("--expert-tensor-parallel-size", "expert_tp")):
        if a.given(flag):
            d.set(f"parallel.{key}", a.number(flag))
    kinds = a.texts("--cp-comm-type")
    if kinds:
        kind = {"p2p": "p2p", "all_gather": "allgather", "a2a": "a2a",
                "a2a+p2p": "a2a+p2p"}.get(kinds[0])
        if len(set(kinds)) > 1 or kind is None:
            d.note("--cp-comm-type", kinds, "parallel.cp_comm_type is one of p2p, allgather, "
                   "a2a, a2a+p2p for every layer; simulated as p2p")
        else:
            d.set("parallel.cp_comm_type", kind)
    hierarchical(a, d)


def hierarchical(a: Parsed, d: Draft) -> None:
    """``--hierarchical-context-parallel-sizes A R`` (A adjacent ranks, then R of those
    groups; Transformer Engine's a2a+p2p takes exactly two levels): ``cp_a2a`` A. Only
    a2a+p2p reads it."""
    flag = "--hierarchical-context-parallel-sizes"
    sizes = a.texts(flag)
    if d.get("parallel.cp_comm_type") != "a2a+p2p":
        if sizes:
            d.note(flag, sizes, "only --cp-comm-type a2a+p2p uses it; ignored")
        return
    cp = d.get("parallel.cp", 1)
    if len(sizes) != 2 or not all(x.isdigit() and int(x) > 0 for x in sizes) \
            or int(sizes[0]) * int(sizes[1]) != cp:
        raise UserError([Problem(flag, " ".join(sizes) or "(absent)", "--cp-comm-type a2a+p2p "
                                 "needs two sizes, the all-to-all's then the ring's, whose "
                                 f"product is --context-parallel-size ({cp}), as Transformer "
                                 "Engine and Megatron-LM take them")])
    d.set("parallel.cp_a2a", int(sizes[0]))


def virtual_stages(a: Parsed, d: Draft) -> None:
    pp, layers = d.get("parallel.pp"), a.number("--num-layers")
    v = a.number("--num-virtual-stages-per-pipeline-rank") \
        or a.number("--virtual-pipeline-model-parallel-size")
    per_chunk = a.number("--num-layers-per-virtual-pipeline-stage")
    if per_chunk is not None and layers is not None:
        if per_chunk < 1 or layers % (pp * per_chunk):
            raise UserError([Problem("--num-layers-per-virtual-pipeline-stage", per_chunk,
                                     f"--num-layers ({layers}) must be a multiple of it times "
                                     f"the pipeline size ({pp})")])
        v = layers // (pp * per_chunk)
    if pp > 1:
        d.set("parallel.schedule", "interleaved" if v and v > 1 else "1f1b")
    if v and v > 1:
        d.set("parallel.virtual_stages", v)


def sharding(a: Parsed, d: Draft) -> None:
    zero = 1 if a.given("--use-distributed-optimizer") else 0
    if a.given("--use-torch-fsdp2"):
        zero = 3
    if a.given("--use-megatron-fsdp"):
        strategy = a.text("--data-parallel-sharding-strategy", "optim_grads_params")
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(
            strategy or "", 3)
    d.set("parallel.zero", zero)


def recompute(a: Parsed, d: Draft) -> None:
    granularity = a.text("--recompute-granularity")
    if a.given("--recompute-activations"):
        granularity = "selective"
    if a.given("--checkpoint-activations"):  # Megatron-LM before 2022: full, every layer
        granularity = "full"
    if granularity not in (None, "full", "selective"):
        raise UserError([Problem("--recompute-granularity", granularity, "expected full or "
                                 "selective")])
    d.set("parallel.recompute", granularity or "none")
    method, count = a.text("--recompute-method"), a.number("--recompute-num-layers")
    if granularity == "full" and method == "block" and count is not None:
        # TransformerBlock._checkpointed_forward: the first N layers of each model chunk
        d.set("parallel.recompute_num_layers", int(count))
    elif granularity == "full" and count not in (None, 1):  # uniform: groups of N
        d.set("parallel.recompute_group", int(count))
    modules = a.texts("--recompute-modules")
    if granularity == "selective" and modules:  # TransformerConfig.recompute_modules
        known = get_args(RecomputeModule)
        if modules != ["core_attn"]:
            d.set("parallel.recompute_modules", [m for m in modules if m in known])
        other = [m for m in modules if m not in known]
        if other:
            d.note("--recompute-modules", other, "modules of layer kinds not simulated "
                   "(gated delta nets, hyper-connections); left out")


def batch(a: Parsed, d: Draft) -> None:
    micro = a.number("--micro-batch-size")
    if micro is None:
        raise UserError([Problem("--micro-batch-size", "absent", "Megatron-LM requires it; "
                                 "add --micro-batch-size N")])
    d.set("training.micro_batch", micro)
    if a.given("--global-batch-size"):
        d.set("training.global_batch", a.number("--global-batch-size"))
    for flag in ("--rampup-batch-size", "--step-batch-size-schedule"):
        if a.given(flag):
            d.note(flag, a.texts(flag), "a batch-size ramp-up: the scenario simulates the "
                   "step at the full --global-batch-size")


#: Megatron's --fp8-recipe -> stack.fp8 (megatron/core/transformer/transformer_config.py
#: ``fp8_recipe``, default delayed; "tensorwise" is per-tensor current scaling)
FP8_RECIPES = {"delayed": "delayed", "tensorwise": "current", "blockwise": "blockwise",
               "mxfp8": "mxfp8"}


def precision(a: Parsed, d: Draft) -> None:
    if a.given("--bf16") and a.given("--fp16"):
        raise UserError([Problem("--bf16", "with --fp16", "give one of them")])
    d.set("training.dtype", "bf16" if a.given("--bf16") else "fp16" if a.given("--fp16")
          else "fp32")
    if a.given("--fp8-format"):  # e4m3 or hybrid: one byte either way
        recipe = a.text("--fp8-recipe", "delayed") or "delayed"
        if recipe in FP8_RECIPES:
            d.set("stack.fp8", FP8_RECIPES[recipe])
        else:
            d.note("--fp8-recipe", recipe, "no stack.fp8 for a custom recipe; simulated in "
                   f"{d.get('training.dtype')}")
    if a.given("--grad-reduce-in-bf16"):
        d.set("stack.grad_reduce_dtype", "param")


def overlap(a: Parsed, d: Draft) -> None:
    d.set("parallel.overlap.dp", a.given("--overlap-grad-reduce"))
    if a.given("--no-overlap-p2p-communication"):
        d.set("parallel.overlap.pp", False)
    if a.given("--overlap-param-gather"):
        d.note("--overlap-param-gather", "", "no field: the distributed optimizer's "
               "parameter all-gather is simulated after the optimizer step")
    if a.given("--tp-comm-overlap"):
        d.set("stack.tp_overlap", "pipelined")


ATTENTION = {"flash": "flash2", "fused": "cudnn", "unfused": "unfused_fused_softmax",
             "local": "unfused_fused_softmax"}


def kernels(a: Parsed, d: Draft) -> None:
    backend = a.text("--attention-backend", "auto")  # auto: the stack preset's own choice
    if backend != "auto" and backend not in ATTENTION:
        raise UserError([Problem("--attention-backend", backend, "expected one of auto, "
                                 f"{', '.join(ATTENTION)}")])
    attention = ATTENTION.get(backend or "")
    if attention is None and a.text("--transformer-impl") == "local":
        attention = "unfused_fused_softmax"  # Megatron's own DotProductAttention
    if a.given("--use-flash-attn"):
        attention = "flash2"
    if attention is not None:
        d.set("stack.attention", attention)
    for flag, key in (("--hidden-dropout", "hidden_dropout"),
                      ("--attention-dropout", "attention_dropout")):
        if a.given(flag):
            d.set(f"stack.{key}", a.number(flag, kind=float))
    if a.given("--clip-grad"):
        d.set("stack.grad_clip", a.number("--clip-grad", kind=float) > 0)
    if a.given("--enable-cuda-graph"):
        d.set("stack.cuda_graphs", True)


#: --tokenizer-type -> the vocabulary it brings without a file (GPT-2's BPE: 50,257)
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257}


def vocab(a: Parsed, d: Draft) -> None:
    """The padded vocabulary: --padded-vocab-size, else the tokenizer's size padded to a
    multiple of --make-vocab-size-divisible-by · tp (Megatron-LM's
    ``_vocab_size_with_padding``), unless --no-pad-vocab-size."""
    padded = a.number("--padded-vocab-size")
    if padded is None:
        size = a.number("--vocab-size") or TOKENIZER_VOCAB.get(a.text("--tokenizer-type") or "")
        if size is None:
            raise UserError([Problem("--vocab-size", "absent", "the vocabulary comes from a "
                                     "tokenizer file; add --vocab-size N (or "
                                     "--padded-vocab-size N, or --tokenizer-type "
                                     "GPT2BPETokenizer)")])
        multiple = a.number("--make-vocab-size-divisible-by", 128) * d.get("parallel.tp", 1)
        padded = size if a.given("--no-pad-vocab-size") else -(-size // multiple) * multiple
    d.set("model.vocab", padded)


def _required(a: Parsed, flag: str) -> int:
    value = a.number(flag)
    if value is None:
        raise UserError([Problem(flag, "absent", f"Megatron-LM requires it; add {flag} N")])
    return int(value)


def dense(a: Parsed, d: Draft) -> None:
    hidden, heads = _required(a, "--hidden-size"), _required(a, "--num-attention-heads")
    d.set("model.layers", _required(a, "--num-layers"))
    d.set("model.hidden", hidden)
    d.set("model.heads", heads)
    d.set("model.seq_len", _required(a, "--seq-length"))
    swiglu = a.given("--swiglu")
    ffn = a.number("--ffn-hidden-size") or (int(4 * hidden * 2 / 3 / 64) * 64 if swiglu
                                            else 4 * hidden)
    d.set("model.ffn_hidden", ffn)
    d.set("model.activation", "swiglu" if swiglu else "gelu")
    if a.given("--group-query-attention"):
        d.set("model.kv_heads", a.number("--num-query-groups", 1))
    channels = a.number("--kv-channels")  # validate_args: hidden / heads when absent
    if channels is not None and channels * heads != hidden:
        d.set("model.head_dim", channels)
    norm = a.text("--normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise UserError([Problem("--normalization", norm, "expected LayerNorm or RMSNorm")])
    d.set("model.norm", norm.lower())
    d.set("model.bias", not a.given("--disable-bias-linear"))
    d.set("model.tied_embeddings", not a.given("--untie-embeddings-and-output-weights"))
    positions(a, d)


def positions(a: Parsed, d: Draft) -> None:
    kind = a.text("--position-embedding-type", "learned_absolute")
    if a.given("--use-rotary-position-embeddings"):
        kind = "rope"
    if kind not in ("learned_absolute", "rope"):
        d.note("--position-embedding-type", kind, "model.position is learned or rope; "
               "simulated as rope (no parameters)")
        kind = "rope"
    d.set("model.position", "rope" if kind == "rope" else "learned")
    table = a.number("--max-position-embeddings")
    if kind == "learned_absolute" and table not in (None, d.get("model.seq_len")):
        d.note("--max-position-embeddings", table, "the learned table is seq_len rows in "
               "the schema; its other rows' parameters are not counted")


def experts(a: Parsed, d: Draft) -> None:
    count = a.number("--num-experts")
    if count is None:
        return
    d.set("model.experts", count)
    d.set("model.experts_per_token", a.number("--moe-router-topk", 2))
    expert_ffn = a.number("--moe-ffn-hidden-size") or d.get("model.ffn_hidden")
    d.set("model.expert_ffn_hidden", expert_ffn)
    shared = a.number("--moe-shared-expert-intermediate-size")
    if shared:
        if shared % expert_ffn:
            d.note("--moe-shared-expert-intermediate-size", shared, "not a whole number of "
                   f"experts of {expert_ffn}; model.shared_experts rounds it down")
        d.set("model.shared_experts", shared // expert_ffn)
    freq = a.text("--moe-layer-freq", "1") or "1"
    if freq.isdigit():
        d.set("model.moe_layer_freq", int(freq))
    else:
        d.note("--moe-layer-freq", freq, "a pattern: the schema has first_dense_layers and "
               "an every-k-th frequency; set them by hand (simulated: every layer)")
    if a.given("--moe-expert-capacity-factor"):
        d.set("model.capacity_factor", a.number("--moe-expert-capacity-factor", kind=float))
    if a.text("--moe-router-score-function", "softmax") == "sigmoid":
        d.set("model.router", "sigmoid")


def dispatcher(a: Parsed, d: Draft) -> None:
    """The token dispatcher (TransformerConfig's default allgather) and the shared experts'
    overlap; flex is simulated with DeepEP's kernels whatever its backend."""
    if a.number("--num-experts") is None:
        return
    kind = a.text("--moe-token-dispatcher-type", "allgather")
    d.set("parallel.moe_token_dispatcher", kind)
    backend = a.text("--moe-flex-dispatcher-backend", "deepep")
    if kind == "flex" and backend != "deepep" and not a.given("--moe-enable-deepep"):
        d.note("--moe-flex-dispatcher-backend", backend, "only DeepEP's kernels are "
               "modelled for the flex dispatcher; simulated as deepep")
    if a.given("--moe-shared-expert-overlap"):
        d.set("parallel.moe_shared_expert_overlap", True)


def latent(a: Parsed, d: Draft) -> None:
    if not a.given("--multi-latent-attention"):
        return
    d.set("model.mla", {"q_lora_rank": a.number("--q-lora-rank") or 0,
                        "kv_lora_rank": a.number("--kv-lora-rank", 32),
                        "qk_nope_head_dim": a.number("--qk-head-dim", 128),
                        "qk_rope_head_dim": a.number("--qk-pos-emb-head-dim", 64),
                        "v_head_dim": a.number("--v-head-dim", 128)})


def multi_token(a: Parsed, d: Draft) -> None:
    """``--mtp-num-layers`` (a ``TransformerConfig`` field, default None: no MTP) is
    model.mtp_layers."""
    layers = a.number("--mtp-num-layers")
    if layers:
        d.set("model.mtp_layers", layers)


RULES: tuple[Rule, ...] = (
    Rule(("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
          "--context-parallel-size", "--expert-model-parallel-size",
          "--expert-tensor-parallel-size", "--cp-comm-type",
          "--hierarchical-context-parallel-sizes"), degrees),
    Rule(("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
          "--num-layers-per-virtual-pipeline-stage"), virtual_stages),
    Rule(("--sequence-parallel",), lambda a, d: d.set("parallel.sequence_parallel",
                                                      a.given("--sequence-parallel"))),
    Rule(("--use-distributed-optimizer", "--use-torch-fsdp2", "--use-megatron-fsdp",
          "--data-parallel-sharding-strategy"), sharding),
    Rule(("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
          "--recompute-activations", "--checkpoint-activations", "--recompute-modules"),
         recompute),
    Rule(("--micro-batch-size", "--global-batch-size", "--rampup-batch-size",
          "--step-batch-size-schedule"), batch),
    Rule(("--bf16", "--fp16", "--fp8-format", "--fp8-recipe", "--grad-reduce-in-bf16"),
         precision),
    Rule((FLAG, *DTYPES), optimizer_states),  # after precision: it reads dtype and fp8
    Rule(("--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
          "--no-overlap-p2p-communication"), overlap),
    Rule(("--attention-backend", "--transformer-impl", "--use-flash-attn", "--hidden-dropout",
          "--attention-dropout", "--clip-grad", "--enable-cuda-graph"), kernels),
    Rule(("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
          "--ffn-hidden-size", "--swiglu", "--group-query-attention", "--num-query-groups",
          "--kv-channels", "--normalization", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--position-embedding-type",
          "--use-rotary-position-embeddings", "--max-position-embeddings"), dense),
    Rule(("--padded-vocab-size", "--vocab-size", "--make-vocab-size-divisible-by",
          "--tokenizer-type", "--no-pad-vocab-size"), vocab),
    Rule(("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
          "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
          "--moe-expert-capacity-factor", "--moe-router-score-function"), experts),
    Rule(("--moe-token-dispatcher-type", "--moe-enable-deepep", "--moe-flex-dispatcher-backend",
          "--moe-shared-expert-overlap"), dispatcher),
    Rule(("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
          "--qk-pos-emb-head-dim", "--v-head-dim"), latent),
    Rule(("--mtp-num-layers",), multi_token),
)

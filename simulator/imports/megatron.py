"""Megatron-LM launch arguments -> a scenario.

Input: the arguments of ``pretrain_gpt.py`` as Megatron-LM's parser takes them
(megatron/training/arguments.py, ``add_megatron_arguments``), optionally preceded by the
launcher's (``torchrun --nproc_per_node 8 --nnodes 128 ... pretrain_gpt.py``: the
GPU count is read from them). Every argument of the parser at the commit named in
``megatron_arguments.tsv`` is classed:

- mapped: read by a rule of :mod:`simulator.imports.megatron_rules` into a scenario field;
- ignored by design (:data:`IGNORED_GROUPS`, :data:`IGNORED_PREFIXES`): it does not bear
  on a simulated step (paths, logging, checkpoints, learning rates, seeds);
- unmapped: it bears on the step but the scenario has no field for it; listed, with
  what is simulated instead (Megatron-LM's default behaviour).

A flag the parser does not know is listed too (with the closest known spelling), never
dropped. Older spellings that scripts still carry are in :data:`LEGACY`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from simulator.errors import Problem, UserError
from simulator.imports.common import Draft, layout, model_section
from simulator.imports.megatron_rules import RULES, Parsed

TABLE = Path(__file__).with_name("megatron_arguments.tsv")

#: Arguments of Megatron-LM versions before the table's commit -> how many values they take
LEGACY = {"--virtual-pipeline-model-parallel-size": "1"}

_OTHER = "another program's arguments, unused by GPT pre-training"
#: Argument groups of the parser that do not bear on a simulated step, with the reason
IGNORED_GROUPS = {
    "checkpointing": "checkpoint files (clustersim train models checkpoints from "
                     "checkpoint.*)",
    "data and dataloader": "data paths and the loader",
    "tokenizer": "tokenizer files",
    "logging": "logging", "opentelemetry": "logging", "one logger": "logging",
    "profiling": "profiling", "straggler": "straggler logging",
    "workload inspector": "monitoring",
    "validation": "evaluation between steps",
    "autoresume": "job control", "ft_package": "fault tolerance of the real job",
    "In-process restart": "fault tolerance of the real job",
    "rerun engine": "fault tolerance of the real job",
    "fault injector": "fault tolerance of the real job",
    "learning rate and weight decay": "optimizer hyperparameters: no effect on time or memory",
    "regularization": "optimizer hyperparameters: no effect on time or memory",
    "RNG and initialization": "seeds and initial values",
    "biencoder": _OTHER, "vision": _OTHER, "Logits Distillation": _OTHER, "sft": _OTHER,
    "rl": _OTHER, "inference": _OTHER, "msc": "storage client",
}
#: Flags of the other groups that do not bear on a step either, by prefix
IGNORED_PREFIXES = {
    "--train-iters": "run length: give clustersim train --tokens",
    "--train-samples": "run length: give clustersim train --tokens",
    "--exit-": "job control", "--manual-gc": "host garbage collection",
    "--distributed-backend": "the backend (NCCL is simulated)",
    "--distributed-timeout": "timeouts", "--local-rank": "set by the launcher",
    "--lazy-mpu-init": "job control", "--flight-recorder": "debugging", "--no-flight-recorder":
    "debugging", "--disable-flight-recorder": "debugging", "--init-method": "initial values",
    "--embedding-init-method": "initial values", "--use-cpu-initialization": "initial values",
    "--no-initialization": "initial values", "--init-model-with-meta-device": "initial values",
    "--config-logger-dir": "logging", "--check-": "debugging checks",
    "--no-check-for-nan": "debugging checks", "--result-rejected-tracker": "debugging checks",
    "--dump-param-to-param-group-map": "debugging", "--use-mcore-models": "Megatron Core is "
    "the only model code now", "--iterations-to-skip": "job control", "--seed": "seeds",
    "--deterministic-mode": "numerics only", "--fake-process-group": "testing",
    "--nccl-communicator-config-path": "NCCL tuning file", "--onnx-safe": "export",
    "--bert-no-binary-head": _OTHER, "--encoder-": _OTHER, "--decoder-num-layers": _OTHER,
    "--max-position-embeddings": "read with --position-embedding-type",
    "--rotary-": "numerics only", "--rope-scaling-factor": "numerics only",
    "--use-rope-scaling": "numerics only", "--norm-epsilon": "numerics only",
    "--mtp-loss-scaling-factor": "the MTP loss's weight: no effect on time or memory",
}
UNMAPPED = "no field in the scenario schema; simulated without it"


@dataclass(frozen=True)
class Argument:
    names: tuple[str, ...]
    arity: str  # 0, 1, 3, * or +
    group: str


@lru_cache(maxsize=1)
def arguments() -> dict[str, Argument]:
    """Every option string of the parser (aliases included) -> its argument."""
    out: dict[str, Argument] = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        names, arity, group = line.split("\t")
        arg = Argument(tuple(names.split("|")), arity, group)
        out.update(dict.fromkeys(arg.names, arg))
    for name, arity in LEGACY.items():
        out[name] = Argument((name,), arity, "legacy")
    return out


def mapped_flags() -> set[str]:
    return {flag for rule in RULES for flag in rule.flags}


def classify(flag: str) -> tuple[str, str]:
    """(mapped | ignored | unmapped | unknown, the reason) for one option string."""
    arg = arguments().get(flag)
    if arg is None:
        near = difflib.get_close_matches(flag, list(arguments()), n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        return "unknown", f"not an argument of Megatron-LM's parser{hint}"
    if arg.names[0] in mapped_flags() or flag in mapped_flags():
        return "mapped", ""
    if arg.group in IGNORED_GROUPS:
        return "ignored", IGNORED_GROUPS[arg.group]
    for prefix, reason in IGNORED_PREFIXES.items():
        if flag.startswith(prefix):
            return "ignored", reason
    return "unmapped", UNMAPPED


def split_launcher(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's arguments, the script's): split at the first ``*.py`` word."""
    for i, word in enumerate(argv):
        if word.endswith(".py") and not word.startswith("-"):
            return argv[:i], argv[i + 1:]
    return [], argv


def launcher_gpus(words: list[str]) -> tuple[int | None, int | None]:
    """(nodes, GPUs per node) from torchrun's ``--nnodes`` and ``--nproc_per_node``."""
    found: dict[str, str] = {}
    for i, word in enumerate(words):
        key, _, inline = word.partition("=")
        key = key.replace("_", "-")
        if key in ("--nnodes", "--nproc-per-node"):
            value = inline or (words[i + 1] if i + 1 < len(words) else "")
            if not value.isdigit() or int(value) < 1:
                raise UserError([Problem(key, value, "expected a whole number >= 1 (an "
                                         "elastic range MIN:MAX is not a GPU count)")])
            found[key] = value
    nodes, per = found.get("--nnodes"), found.get("--nproc-per-node")
    return (int(nodes) if nodes else None), (int(per) if per else None)


def tokenize(words: list[str]) -> tuple[dict[str, list[str]], list[tuple[str, list[str]]]]:
    """(known option -> its values under the first spelling, [(unknown option, values)]);
    a repeated option keeps its last values, as argparse does."""
    known: dict[str, list[str]] = {}
    unknown: list[tuple[str, list[str]]] = []
    i, last = 0, ""
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            after = f" after {last}, which takes one value" if last else ""
            raise UserError([Problem("megatron", word, f"a value without its option{after}; "
                                     "quote a value that has spaces")])
        last = word
        flag, eq, inline = word.partition("=")
        arg = arguments().get(flag)
        take = arg.arity if arg else "*"
        j = i + 1
        if eq:
            values = [inline]
        elif take in ("*", "+"):
            while j < len(words) and not words[j].startswith("--"):
                j += 1
            values = words[i + 1:j]
        else:
            j = i + 1 + int(take)
            values = words[i + 1:j]
            if len(values) < int(take) or any(v.startswith("--") for v in values):
                raise UserError([Problem(flag, " ".join(values) or "nothing",
                                         f"takes {take} value(s)")])
        if arg is None:
            unknown.append((flag, values))
        else:
            known[arg.names[0]] = values
        i = j
    return known, unknown


def import_megatron(argv: list[str], system: str, nodes: int | None, gpus: int | None,
                    stack: str, name: str) -> Draft:
    """The draft scenario of one launch line (validated by the caller)."""
    launcher, script = split_launcher(argv)
    launch_nodes, per_node = launcher_gpus(launcher)
    known, unknown = tokenize(script)
    d = Draft()
    d.set("name", name)
    d.set("stack", {"preset": stack})
    parsed = Parsed(known)
    for rule in RULES:
        rule.apply(parsed, d)
    if nodes is None and gpus is None and launch_nodes is not None:
        gpus = launch_nodes * per_node if per_node else None
        nodes = None if per_node else launch_nodes
    elif launch_nodes is not None:
        given = f"--nodes {nodes}" if nodes is not None else f"--gpus {gpus}"
        d.note("torchrun --nnodes", launch_nodes, f"the launcher's; {given} given instead")
    layout(d, system, nodes, gpus, "megatron")
    d.set("model", model_section(d.data["model"]))
    if d.get("training.global_batch") is None:  # Megatron's default: one micro-batch per rank
        d.set("training.global_batch", d.get("training.micro_batch") * d.get("parallel.dp"))
    for flag, values in known.items():
        kind, reason = classify(flag)
        if kind == "unmapped":
            d.note(flag, values, reason)
    for flag, values in unknown:
        d.note(flag, values, classify(flag)[1])
    return d

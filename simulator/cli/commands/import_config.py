"""``clustersim import``: a framework's own configuration -> a scenario YAML that
``clustersim run`` takes. ``import megatron -- ARGS...`` reads Megatron-LM launch
arguments (optionally with the torchrun words before ``pretrain_gpt.py``);
``import torchtitan FILE.toml`` a torchtitan job config. Settings the scenario cannot
express are listed on stderr and at the top of the file; docs/imports.md has the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from simulator.cli.common import Subparsers, add_command, positive_int

HELP = "turn a Megatron-LM launch line or a torchtitan TOML into a scenario YAML"
EXAMPLE = ("examples:\n"
           "  clustersim import megatron --nodes 128 --system dgx-a100-80gb --out gpt3.yaml -- \\\n"
           "      --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 \\\n"
           "      --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\\n"
           "      --seq-length 2048 --micro-batch-size 1 --global-batch-size 1536 --bf16 \\\n"
           "      --tokenizer-type GPT2BPETokenizer\n"
           "  clustersim import torchtitan llama3_8b.toml --gpus 8 --out llama3-8b.yaml\n"
           "  clustersim run gpt3.yaml")
SOURCES = {"megatron": ("Megatron-LM launch arguments (after --)", "megatron-core"),
           "torchtitan": ("a torchtitan TOML job config", "torchtitan")}


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "import", HELP, EXAMPLE)
    inner = q.add_subparsers(dest="source", required=True, metavar="SOURCE")
    for source, (what, stack) in SOURCES.items():
        p = add_command(inner, source, f"import {what}", EXAMPLE)
        if source == "megatron":
            p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                           help="the launch arguments, after --")
        else:
            p.add_argument("config", type=Path, metavar="FILE.toml", help="the job config")
        p.add_argument("--out", type=Path, default=None, metavar="FILE.yaml",
                       help="where to write the scenario (default: stdout)")
        p.add_argument("--system", default="dgx-h100", metavar="PRESET",
                       help="hardware system (`clustersim presets`; default dgx-h100)")
        size = p.add_mutually_exclusive_group()
        size.add_argument("--nodes", type=positive_int, default=None,
                          help="nodes of the system (the configuration does not say; "
                          "Megatron: overrides torchrun's --nnodes)")
        size.add_argument("--gpus", type=positive_int, default=None, help="GPUs in all")
        p.add_argument("--stack", default=stack, metavar="PRESET",
                       help=f"stack preset the flags override (default {stack})")
        p.add_argument("--name", default=None, help="scenario name (default: the output's "
                       "file name)")
        p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.imports.common import emit, finish, render

    if args.source == "megatron":
        from simulator.imports.megatron import import_megatron

        argv = args.args[1:] if args.args[:1] == ["--"] else args.args
        name = args.name or (args.out.stem if args.out else "megatron-import")
        draft = import_megatron(argv, args.system, args.nodes, args.gpus, args.stack, name)
        origin = "Megatron-LM launch arguments"
    else:
        from simulator.imports.torchtitan import import_torchtitan

        name = args.name or (args.out.stem if args.out else args.config.stem)
        draft = import_torchtitan(args.config, args.system, args.nodes, args.gpus,
                                  args.stack, name)
        origin = f"the torchtitan config {args.config.name}"
    data = finish(draft)
    emit(render(data, draft.notes, origin), draft.notes, args.out)
    return 0

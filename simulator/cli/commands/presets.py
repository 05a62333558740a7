"""``clustersim presets``: list bundled models, systems and training stacks."""

from __future__ import annotations

import argparse

from simulator.cli.common import (
    Subparsers,
    add_command,
)

HELP = "list bundled models, systems and training stacks"
EXAMPLE = ("example:\n"
           "  clustersim presets")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "presets", HELP, EXAMPLE)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _models()
    _systems()
    _stacks()
    return 0


def _models() -> None:
    from simulator.model import transformer as mdl
    from simulator.spec.model_spec import load_preset_model, preset_model_names

    print("models:")
    for name in preset_model_names():
        spec = load_preset_model(name)
        moe = (f" experts={spec.experts} top-{spec.experts_per_token}, "
               f"{mdl.active_param_count(spec) / 1e9:.2f} B active "
               f"({mdl.active_param_count(spec, embedding=False) / 1e9:.2f} B without the "
               "input embedding)") if spec.is_moe else ""
        print(f"  {name:<14} {mdl.param_count(spec) / 1e9:8.2f} B params  l={spec.layers} "
              f"h={spec.hidden} a={spec.heads}"
              f"{f' d={spec.head_size}' if spec.q_width != spec.hidden else ''} kv={spec.kv} "
              f"ffn={spec.ffn} V={spec.vocab} "
              f"s={spec.seq_len}{moe}")


def _systems() -> None:
    from simulator.system.profiles import load_system, preset_system_names

    print("systems:")
    for name in preset_system_names():
        hw = load_system(name)
        bf16 = hw.gpu.peak_tflops.get("bf16", 0.0)
        domain = (f" (NVLink domain {hw.domain_gpus} GPUs)"
                  if hw.domain_gpus > hw.gpus_per_node else "")
        print(f"  {name:<14} {hw.gpus_per_node} x {hw.gpu.name}{domain}: {bf16:g} TFLOP/s "
              f"bf16, {hw.gpu.memory_GB:g} GB, NVLink {hw.intra_node.bandwidth_GBps:g} GB/s, "
              f"NIC {hw.inter_node.bandwidth_GBps:g} GB/s per GPU")


def _stacks() -> None:
    """Each stack preset (``stack: NAME``) with its own one-line description."""
    from simulator.spec.stack import DEFAULT_STACK, load_stack, preset_stack_names

    print(f"stacks (stack: NAME; default {DEFAULT_STACK}):")
    for name in preset_stack_names():
        print(f"  {name:<14} {load_stack(name).description}")

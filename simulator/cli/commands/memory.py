"""``clustersim memory``: per-rank memory table and out-of-memory verdict."""

from __future__ import annotations

import argparse

from simulator.cli.common import (
    Subparsers,
    add_command,
    load,
    scenario_args,
)
from simulator.cli.exit_codes import allow_oom_arg, fit_status, memory_verdict

HELP = "per-rank memory table and out-of-memory verdict"
EXAMPLE = ("example:\n"
           "  clustersim memory scenarios/gpt3-175b-1024.yaml --set parallel.zero=1")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "memory", HELP, EXAMPLE, exit_codes=True)
    scenario_args(q)
    allow_oom_arg(q)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.analysis.memory import memory_items, memory_report, stage_rows
    from simulator.builder.budget import check_stages
    from simulator.spec.recompute import describe

    s = load(args)
    check_stages(s)
    gb = 1e9
    cols = ("stage", "weights", "grads", "optimizer", "activations", "logits", "buffers",
            "device", "total", "fits")
    print(f"{s.name}: per-GPU memory in GB (capacity {s.hardware.gpu.memory_GB:g} GB, "
          f"ZeRO-{s.parallel.zero}, {s.parallel.schedule}, recompute {describe(s.parallel)})")
    print("  ".join(f"{c:>11}" for c in cols))
    report = memory_report(s)
    for m in report:
        vals = (m.weights, m.gradients, m.optimizer, m.activations, m.logits, m.comm_buffers,
                m.runtime, m.total)
        print("  ".join([f"{m.stage:>11}", *(f"{v / gb:>11.2f}" for v in vals),
                         f"{'yes' if m.fits else 'NO':>11}"]))
    peak = max(report, key=lambda item: item.total)
    print(f"\nstage {peak.stage} (the peak), item by item:")
    for name, nbytes, source in memory_items(peak, s):
        print(f"  {name:<20} {nbytes / gb:>8.2f} GB  {source}")
    verdict = memory_verdict(stage_rows(report))
    print(verdict.line())
    return fit_status(verdict, args.allow_oom)

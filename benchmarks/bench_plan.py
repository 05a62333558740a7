"""Planner benchmark: the plans of the issues, their wall time and what they considered.

GPT-3 175B on 1,024 A100-80GB (global batch 1536, sequence 2048) and Llama-3
70B on 512 H100 (global batch 1024, sequence 8192), each planned as
``clustersim plan`` does (``--workers`` local processes, default 2; no cache, so
every engine re-simulation is run). Reports wall seconds, CPU seconds of this
process and its workers, candidates per CPU second, candidates considered /
invalid / not yet simulated / out of memory / fitting, and the chosen layout with
its engine step time. The Llama-3 plan's 8,192 tokens also enumerate CP 2
(:data:`simulator.strategies.context.strategy.CP_MIN_TOKENS`).
Target (issue "Scale and search", item 2): each plan ≤ 60 s on two cores with
≥ 10,000 candidates.

The large search (issue 44, item 6: ≥ 100,000 candidates within 60 s): Llama-3 70B
at its 128K context (sequence 131,072, global batch 512: 64 Mi tokens a step) on
2,048 GB200 (NVL72 racks, so TP up to 64 stays in an NVLink domain), CP 1 to 32
searched. Mixtral 8x7B on 64 H100 (global batch 256, its 32,768 tokens) searches the
MoE dimensions: EP and the token dispatcher.

Every plan searches the planner's whole default space (:mod:`simulator.search.space`:
the CP exchange, the dispatcher, hybrid sharding, the per-op policy and Megatron's
recompute modules besides). "Candidates" are those assessed; "left out" those a
sibling showed could not win (:mod:`simulator.search.dominance`), enumerated but not
assessed. The rates are candidates a wall second, assessed and considered (assessed +
left out).

Nothing fails when a target is missed; on a shared machine read the CPU seconds too.

Usage::

    python benchmarks/bench_plan.py
    python benchmarks/bench_plan.py --top 5 --workers 2 --json out/bench_plan.json
    python benchmarks/bench_plan.py --only large
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.search.candidates import PlanRequest  # noqa: E402
from simulator.search.executors import open_executor  # noqa: E402
from simulator.search.plan import layout_label, run_plan  # noqa: E402

TARGET_S = 60.0
#: (name, request, the fewest candidates its target asks for)
PLANS = (
    ("gpt3", PlanRequest("gpt3-175b", 1024, "dgx-a100-80gb", 1536, 2048), 10_000),
    ("llama3", PlanRequest("llama3-70b", 512, "dgx-h100", 1024, 8192), 10_000),
    ("mixtral", PlanRequest("mixtral-8x7b", 64, "dgx-h100", 256), 10_000),
    # its variants (CP exchanges above all) take it past the default limit of 200,000
    ("large", PlanRequest("llama3-70b", 2048, "gb200-nvl72", 512, 131072,
                          max_candidates=600_000), 100_000),
)


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers, once they have exited
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench(req: PlanRequest, workers: int) -> dict[str, Any]:
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    with open_executor(None, workers) as pool:
        plan = run_plan(req, pool)
    wall, cpu = time.perf_counter() - wall0, _cpu_s() - cpu0
    assert plan.chosen is not None, "something fits"
    best = plan.table.loc[plan.chosen]
    return {"model": req.model, "gpus": req.gpus, "system": req.system,
            "global_batch": req.global_batch, "seq_len": req.seq_len, "top_k": req.top_k,
            "wall_s": wall, "cpu_s": cpu, "candidates_per_cpu_s": len(plan.table) / cpu,
            "candidates_per_wall_s": len(plan.table) / wall,
            "considered_per_wall_s": (len(plan.table) + plan.counts["dominated"]) / wall,
            **plan.counts, "best": layout_label(best),
            "best_engine_step_s": float(best["engine_step_time_s"]),
            "best_mfu": float(best["engine_mfu"]),
            "best_peak_memory_GB": float(best["peak_memory_GB"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--top", type=int, default=5, help="engine re-simulations per plan")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--only", choices=[name for name, _, _ in PLANS], action="append",
                   help="run this plan only (repeatable; default all)")
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, "
          f"{args.workers} workers")
    rows = []
    for name, req, fewest in PLANS:
        if args.only and name not in args.only:
            continue
        row = bench(PlanRequest(**{**req.__dict__, "top_k": args.top}), args.workers)
        met = row["wall_s"] <= TARGET_S and row["candidates"] >= fewest
        row.update(plan=name, target_candidates=fewest, target_met=met)
        rows.append(row)
        print(f"{row['model']} on {row['gpus']:,} ({row['system']}): {row['wall_s']:.1f} s wall, "
              f"{row['cpu_s']:.1f} s CPU ({row['candidates_per_cpu_s']:,.0f} candidates a CPU "
              f"second), {row['candidates']:,} candidates ({row['invalid']:,} "
              f"invalid, {row['not_yet_simulated']:,} not yet simulated, "
              f"{row['out_of_memory']:,} out of memory, {row['fit']:,} fit; "
              f"{row['dominated']:,} left out), {row['simulated']} simulated; "
              f"{row['candidates_per_wall_s']:,.0f} assessed and "
              f"{row['considered_per_wall_s']:,.0f} considered a wall second; target (>= "
              f"{fewest:,} candidates, <= {TARGET_S:.0f} s) {'met' if met else 'MISSED'}")
        print(f"  best: {row['best']}: {row['best_engine_step_s']:.3f} s, MFU "
              f"{row['best_mfu']:.1%}, {row['best_peak_memory_GB']:.1f} GB")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

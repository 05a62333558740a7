"""Asymmetric folding benchmark: what one straggler costs a folded simulation.

GPT-3 175B on 1,024 A100-80GB (the bundled ``gpt3-175b-1024`` scenario) folded,
symmetric, then with one slow GPU (``gpt3-175b-1024-slow-gpu``) and one slow NIC
(``gpt3-175b-1024-slow-nic``). For each: ranks simulated, build + simulate +
accounting seconds (wall and CPU of this process), and the ratio to the
symmetric run. Target (issue "Real clusters are not symmetric"): one straggler
at 1,024 GPUs simulates folded in under 3× the symmetric run's time. Nothing
fails when it is missed; on a shared machine read the CPU ratio.

Usage::

    python benchmarks/bench_variability.py [--json out/bench_variability.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.api import run_scenario  # noqa: E402
from simulator.spec.load import load_scenario  # noqa: E402

SCENARIOS = ("gpt3-175b-1024", "gpt3-175b-1024-slow-gpu", "gpt3-175b-1024-slow-nic")
TARGET_RATIO = 3.0


def measure(name: str) -> dict[str, Any]:
    s = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    wall, cpu = time.perf_counter(), time.process_time()
    run = run_scenario(s, "engine", "folded", trace_ranks=None)
    return {"scenario": name, "ranks_simulated": run.results["ranks_simulated"],
            "step_time_s": run.results["step_time_s"],
            "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = [measure(name) for name in SCENARIOS]
    base = rows[0]
    print(f"{'scenario':<26} {'ranks':>5} {'step s':>8} {'wall s':>7} {'cpu s':>7} "
          f"{'cpu ×':>6}")
    for r in rows:
        r["cpu_ratio"] = r["cpu_s"] / base["cpu_s"]
        r["wall_ratio"] = r["wall_s"] / base["wall_s"]
        print(f"{r['scenario']:<26} {r['ranks_simulated']:>5} {r['step_time_s']:>8.3f} "
              f"{r['wall_s']:>7.2f} {r['cpu_s']:>7.2f} {r['cpu_ratio']:>6.2f}")
    worst = max(r["cpu_ratio"] for r in rows[1:])
    print(f"worst straggler / symmetric CPU ratio {worst:.2f} (target < {TARGET_RATIO:g}): "
          f"{'met' if worst < TARGET_RATIO else 'missed'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

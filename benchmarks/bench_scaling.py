"""Scaling curve: simulation time against GPU count, folded and full.

GPT-3 175B (TP 8; PP 8 at 64 GPUs, else PP 16; DP fills the cluster; 1F1B; m = 32
micro-batches per pipeline at any size, so every size simulates the same step
shape) from 64 to 131,072 GPUs folded and from 64 to 4,096 full. For each point:
ranks simulated, tasks, build and simulate seconds (CPU of this process), and the
engine's tasks per CPU second. Folded time stays flat (one rank per stage stands
for its peers); full time grows with the ranks. Full runs go to a child process
with a wall-clock limit (``--full-timeout``) so a point too slow for the machine
is reported, not waited for.

Usage::

    python benchmarks/bench_scaling.py [--full-max 4096] [--json out/bench_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FOLDED = (64, 128, 512, 2048, 8192, 32768, 131072)
FULL = (64, 128, 256, 512, 1024, 2048, 4096)
M = 32


def scenario_text(gpus: int) -> str:
    pp = 8 if gpus < 128 else 16
    dp = gpus // (8 * pp)
    return (f"name: gpt3-{gpus}\nmodel: {{preset: gpt3-175b}}\n"
            f"cluster: {{system: dgx-a100-80gb, nodes: {gpus // 8}}}\n"
            f"parallel: {{tp: 8, pp: {pp}, dp: {dp}, schedule: 1f1b}}\n"
            f"training: {{global_batch: {M * dp}, micro_batch: 1}}\n")


def measure(gpus: int, fidelity: str) -> dict[str, Any]:
    import yaml  # a dependency of the project already

    from simulator.builder.workload import build_workload
    from simulator.engine.engine import simulate
    from simulator.spec.load import scenario_from_dict

    s = scenario_from_dict(yaml.safe_load(scenario_text(gpus)))
    t0 = time.process_time()
    w = build_workload(s, fidelity=fidelity)
    t1 = time.process_time()
    result = simulate(w, s.hardware)
    t2 = time.process_time()
    return {"gpus": gpus, "fidelity": fidelity, "ranks": len(w.programs),
            "tasks": len(w.tasks), "build_cpu_s": t1 - t0, "simulate_cpu_s": t2 - t1,
            "tasks_per_cpu_s": len(w.tasks) / max(t2 - t1, 1e-9),
            "step_time_s": result.end_time}


def in_child(gpus: int, fidelity: str, timeout: float) -> dict[str, Any]:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from benchmarks.bench_scaling import measure; "
            f"print(json.dumps(measure({gpus}, {fidelity!r})))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"gpus": gpus, "fidelity": fidelity, "error": f"over {timeout:g} s"}
    if out.returncode != 0:
        return {"gpus": gpus, "fidelity": fidelity,
                "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full-max", type=int, default=4096)
    p.add_argument("--full-timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = [in_child(g, "folded", args.full_timeout) for g in FOLDED]
    rows += [in_child(g, "full", args.full_timeout) for g in FULL if g <= args.full_max]
    print(f"{'fidelity':<8} {'GPUs':>7} {'ranks':>6} {'tasks':>10} {'build s':>8} "
          f"{'sim s':>8} {'tasks/s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['fidelity']:<8} {r['gpus']:>7}  {r['error']}")
            continue
        print(f"{r['fidelity']:<8} {r['gpus']:>7} {r['ranks']:>6} {r['tasks']:>10,} "
              f"{r['build_cpu_s']:>8.2f} {r['simulate_cpu_s']:>8.2f} "
              f"{r['tasks_per_cpu_s']:>9,.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

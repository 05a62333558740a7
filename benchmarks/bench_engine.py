"""Engine benchmark: CPU seconds against a bare SimPy loop, peak memory, event rates.

For one scenario (default: the bundled GPT-3 175B on 1,024 GPUs, TP 8 · PP 16 ·
DP 8, 1F1B, m = 192) this times building the workload and simulating one step
with ``fidelity: folded`` (one rank per pipeline stage stands for its peers) and
``fidelity: full`` (every rank, each stage's ranks sharing one prototype
program: :mod:`simulator.builder.program`, each TP group run as one lock-step
process where its ranks provably run alike: :mod:`simulator.engine.lockstep`), and
with ``--full-16k`` Llama 3 405B on 16,384 H100 at full fidelity; counts what the
engine did — tasks executed, SimPy events scheduled (``SimResult.events``) and the
events its chains computed instead (``SimResult.merged_events``) — and
measures, in the same process, a bare SimPy loop of 200,000 request → timeout →
release operations on Resources, before and after the engine runs (the ratios use
the two loops' mean). Each run's figure is its build + simulate CPU seconds over
the bare loop's CPU seconds (CPU time: the ratio to trust when other processes
share the cores); the event rate and the operation rate (engine tasks — a compute
op, a collective, a send — against bare request/timeout/release cycles) are
printed too.

The full-fidelity run goes to a child process with a wall-clock limit
(``--full-timeout``) and an address-space limit (``--full-mem-gb``), so a run
that is too slow or too big is reported rather than taking the machine down; its
peak resident memory is the child's own (``getrusage``). Every run records the
load average (``/proc/loadavg``) before and after it: figures measured on a busy
machine say so.

Targets (issue 44, items 1 and 2), as multiples of the bare loop's CPU seconds:
folded GPT-3 ≤ 0.25×, full GPT-3 on 1,024 GPUs ≤ 10×, full Llama 3 405B on 16,384
GPUs ≤ 100× and ≤ 8 GB resident.

Usage::

    python benchmarks/bench_engine.py                      # folded, full, baseline
    python benchmarks/bench_engine.py --full-16k           # and 405B on 16,384 GPUs
    python benchmarks/bench_engine.py --skip-full --json out/bench.json
    python benchmarks/bench_engine.py --scenario scenarios/llama2-70b-128xh100.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import simpy

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = ROOT / "scenarios" / "gpt3-175b-1024.yaml"
SCENARIO_16K = ROOT / "scenarios" / "llama3-405b-16k-h100.yaml"
# build + simulate CPU seconds over the bare loop's; the 16K run's peak resident memory
TARGETS = {"folded": 0.25, "full": 10.0, "full-16k": 100.0, "full-16k_rss_MB": 8192.0}
BARE_OPERATIONS = 200_000


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages (empty where /proc is not there)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


# ------------------------------------------------------------------ engine runs


def run_engine(scenario: str, fidelity: str, lockstep: bool = True) -> dict[str, Any]:
    """Build and simulate once; times and counts (no report, no files). ``lockstep``
    False: every rank simulated, as before lock-step groups."""
    from simulator.builder.workload import build_workload
    from simulator.engine.engine import simulate
    from simulator.spec.load import load_scenario

    s = load_scenario(scenario)
    load_before = loadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    workload = build_workload(s, fidelity=fidelity)
    t1, c1 = time.perf_counter(), time.process_time()
    result = simulate(workload, s.hardware, lockstep=lockstep)
    t2, c2 = time.perf_counter(), time.process_time()
    tasks = len(result.end)  # one span each (the engine checks every task ran)
    return {
        "fidelity": fidelity,
        "status": "ok",
        "ranks_simulated": len(workload.programs),
        "lockstep_groups": result.lockstep_groups,
        "tasks": tasks,
        "events": result.events,
        # events the per-step path would have scheduled beyond them (engine chains)
        "merged_events": result.merged_events,
        "build_s": t1 - t0,
        "simulate_s": t2 - t1,
        "engine_run_s": result.wall_s,  # env.run() alone, as the engine measures it
        "total_s": t2 - t0,
        # CPU seconds of this process: what one core costs when the machine is shared
        "build_cpu_s": c1 - c0,
        "simulate_cpu_s": c2 - c1,
        "total_cpu_s": c2 - c0,
        "tasks_per_s": tasks / result.wall_s if result.wall_s > 0 else float("nan"),
        "events_per_s": result.events / result.wall_s if result.wall_s > 0 else float("nan"),
        "events_per_cpu_s": (result.events / (c2 - c1)) if c2 > c1 else float("nan"),
        "tasks_per_cpu_s": (tasks / (c2 - c1)) if c2 > c1 else float("nan"),
        "step_time_s": result.end_time,
        # peak resident memory of this process so far (KiB on Linux)
        "max_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }


def best_of(scenario: str, fidelity: str, repeat: int) -> dict[str, Any]:
    """The run of fewest CPU seconds (the targets' figure) of ``repeat``; every run's
    wall and CPU seconds in ``total_s_all`` and ``total_cpu_s_all``."""
    runs = [run_engine(scenario, fidelity) for _ in range(max(repeat, 1))]
    best = min(runs, key=lambda r: r["total_cpu_s"])
    best["repeats"] = len(runs)
    best["total_s_all"] = [r["total_s"] for r in runs]
    best["total_cpu_s_all"] = [r["total_cpu_s"] for r in runs]
    return best


def run_full_in_child(scenario: str, timeout: float, mem_gb: float,
                      label: str = "full", lockstep: bool = True) -> dict[str, Any]:
    """The full-fidelity run in a child process, under a time and a memory limit."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scenario", scenario,
           "--_child", "full", "--full-mem-gb", str(mem_gb)]
    if not lockstep:
        cmd.append("--per-rank")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"fidelity": label, "status": f"timed out after {timeout:g} s",
                "total_s": None}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"fidelity": label, "status": f"failed (exit {proc.returncode}): {tail}",
                "total_s": None, "child_wall_s": wall}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["child_wall_s"] = wall
    out["fidelity"] = label
    out["scenario"] = scenario
    return out


# ------------------------------------------------------------------ bare SimPy


def _count(env: simpy.Environment) -> int:
    """Events scheduled so far: SimPy's heap counter, read as engine.py reads it."""
    return int(next(env._eid)) if hasattr(env, "_eid") else 0


def _bare(cycles: int, procs: int) -> tuple[int, float, float]:
    """``procs`` processes sharing ``cycles`` rounds of: request a Resource, hold it
    for a timeout, release it. Returns (events scheduled, wall and CPU seconds of
    env.run())."""
    env = simpy.Environment()

    def worker(res: simpy.Resource, n: int) -> Generator[simpy.Event, Any, None]:
        for _ in range(n):
            with res.request() as req:
                yield req
                yield env.timeout(1e-6)

    per, extra = divmod(cycles, procs)
    for i in range(procs):
        env.process(worker(simpy.Resource(env, capacity=1), per + (i < extra)))
    t0, c0 = time.perf_counter(), time.process_time()
    env.run()
    return _count(env), time.perf_counter() - t0, time.process_time() - c0


def bare_simpy(cycles: int = BARE_OPERATIONS, procs: int = 16,
               repeat: int = 3) -> dict[str, Any]:
    """The bare loop of ``cycles`` request/timeout/release operations; the fewest CPU
    seconds of ``repeat``, every run's in ``run_cpu_s_all``."""
    load_before = loadavg()
    runs = [_bare(cycles, procs) for _ in range(max(repeat, 1))]
    events, wall, cpu = min(runs, key=lambda r: r[2])
    return {"cycles": cycles, "processes": procs, "events_per_cycle": events / cycles,
            "loadavg_before": load_before, "loadavg_after": loadavg(),
            "events": events, "run_s": wall, "run_cpu_s": cpu, "events_per_s": events / wall,
            "events_per_cpu_s": events / cpu if cpu > 0 else float("nan"),
            "cycles_per_s": cycles / wall,
            "cycles_per_cpu_s": cycles / cpu if cpu > 0 else float("nan"),
            "run_cpu_s_all": [r[2] for r in runs]}


def _mean_bare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two bare loops as one: the mean of their rates, the first's load before and the
    second's after."""
    out = dict(b)
    for key in ("events_per_s", "events_per_cpu_s", "cycles_per_s", "cycles_per_cpu_s"):
        out[key] = (a[key] + b[key]) / 2
    for key in ("run_s", "run_cpu_s"):
        out[key] = (a[key] + b[key]) / 2
    out["run_cpu_s_all"] = a["run_cpu_s_all"] + b["run_cpu_s_all"]
    out["loadavg_before"] = a["loadavg_before"]
    out["each"] = [a, b]
    return out


# ------------------------------------------------------------------ report


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return format(v, spec)


def table(report: dict[str, Any]) -> str:
    cols = [("run", "<", "fidelity"), ("ranks", "d", "ranks_simulated"),
            ("lock-step", "d", "lockstep_groups"),
            ("tasks", ",", "tasks"), ("events", ",", "events"),
            ("chained", ",", "merged_events"),
            ("build s", ".3f", "build_s"), ("sim s", ".3f", "simulate_s"),
            ("total s", ".3f", "total_s"), ("cpu s", ".3f", "total_cpu_s"),
            ("x bare", ".2f", "bare_ratio"),
            ("tasks/s", ",.0f", "tasks_per_s"), ("events/s", ",.0f", "events_per_s"),
            ("step s", ".4f", "step_time_s"), ("max RSS MB", ",.0f", "max_rss_MB"),
            ("load before/after", "<", "load")]

    def cell(text: str, name: str, spec: str) -> str:
        width = max(len(name), 10)
        return text.ljust(width) if spec == "<" else text.rjust(width)

    head = "  ".join(cell(name, name, spec) for name, spec, _ in cols)
    lines = [f"scenario: {report['scenario']}", "", head]
    for run in report["runs"]:
        if run.get("status") != "ok":
            lines.append(f"{run['fidelity']:<8}  {run['status']}")
            continue
        row = {**run, "load": f"{run['loadavg_before']} / {run['loadavg_after']}"}
        lines.append("  ".join(cell(_fmt(row.get(key), "" if spec == "<" else spec), name,
                                    spec) for name, spec, key in cols))
    bare = report["bare_simpy"]
    lines += ["", f"bare SimPy loop, before and after the engine runs (mean): "
              f"{bare['events']:,} events ({bare['cycles']:,} "
              f"request/timeout/release cycles over {bare['processes']} processes) in "
              f"{bare['run_s']:.3f} s wall ({bare['run_cpu_s']:.3f} s CPU) = "
              f"{bare['events_per_s']:,.0f} events/s wall, "
              f"{bare['events_per_cpu_s']:,.0f} per CPU second (load "
              f"{bare['loadavg_before']} / {bare['loadavg_after']})"]
    lines.append("bare loop CPU s, every run: " + ", ".join(
        f"{x:.3f}" for x in bare["run_cpu_s_all"]))
    for run in report["runs"]:  # how noisy the machine was: every repeat's CPU seconds
        if len(run.get("total_cpu_s_all", ())) > 1:
            lines.append(f"{run['fidelity']} CPU s, every run: " + ", ".join(
                f"{x:.3f}" for x in run["total_cpu_s_all"]) + " (x bare " + " to ".join(
                f"{x / bare['run_cpu_s']:.2f}" for x in (min(run["total_cpu_s_all"]),
                                                        max(run["total_cpu_s_all"]))) + ")")
    for name, ratio in report["rate_ratio"].items():
        lines.append(f"engine/bare event rate ({name}): {ratio:.0%}")
    for name, ratio in report["ops_ratio"].items():
        lines.append(f"engine/bare operation rate ({name}, CPU time): {ratio:.0%}  "
                     "(tasks/s over request/timeout/release cycles/s)")
    lines.append("")
    lines.append("targets (build + simulate CPU seconds over the bare loop's; x bare "
                 "above): " + "; ".join(
                     f"{k} {'met' if v else 'MISSED' if v is not None else 'not measured'}"
                     for k, v in report["targets_met"].items()))
    return "\n".join(lines)


def targets_met(runs: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """Each target: met, missed (a run that failed or timed out misses it) or not
    measured (None)."""
    out: dict[str, bool | None] = {}
    for name in ("folded", "full", "full-16k"):
        run = runs.get(name)
        ok = run is not None and run.get("status") == "ok"
        label = f"{name} <= {TARGETS[name]:g}x bare"
        out[label] = None if run is None else ok and run["bare_ratio"] <= TARGETS[name]
        if name == "full-16k":
            out[f"full-16k <= {TARGETS['full-16k_rss_MB'] / 1024:g} GB"] = (
                None if run is None else ok and run["max_rss_MB"] <= TARGETS["full-16k_rss_MB"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example:\n  python benchmarks/bench_engine.py "
                                        "--skip-full --json out/bench.json")
    ap.add_argument("--scenario", default=str(DEFAULT_SCENARIO), help="scenario YAML "
                    "(default: scenarios/gpt3-175b-1024.yaml)")
    ap.add_argument("--skip-full", action="store_true", help="skip the full-fidelity run")
    ap.add_argument("--full-timeout", type=float, default=600.0,
                    help="wall-clock limit of the full-fidelity child process, s (600)")
    ap.add_argument("--full-mem-gb", type=float, default=16.0,
                    help="address-space limit of the full-fidelity child, GB (16)")
    ap.add_argument("--full-16k", action="store_true",
                    help="also run Llama 3 405B on 16,384 GPUs at full fidelity "
                         f"({SCENARIO_16K.relative_to(ROOT)}), in a child process")
    ap.add_argument("--full-16k-timeout", type=float, default=1800.0,
                    help="wall-clock limit of the 16K child process, s (1800)")
    ap.add_argument("--full-16k-mem-gb", type=float, default=12.0,
                    help="address-space limit of the 16K child, GB (12)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="folded runs and bare loops to take the best of (3)")
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin this process (and the child) to one CPU core")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH",
                    help="also write the figures as JSON")
    ap.add_argument("--per-rank", action="store_true",
                    help="full fidelity without lock-step groups (every rank its own "
                         "process), as before lock-step groups")
    ap.add_argument("--_child", choices=["full", "folded"], default=None,
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    if args._child:
        limit = int(args.full_mem_gb * 1e9)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(run_engine(args.scenario, args._child, not args.per_rank)))
        return 0

    # the bare loop before and after the engine runs: the load on a shared machine
    # drifts, and the ratios take the two loops' mean rates
    bare_before = bare_simpy(repeat=args.repeat)
    runs = [best_of(args.scenario, "folded", args.repeat)]
    if not args.skip_full:
        print(f"full fidelity: running in a child process (limit {args.full_timeout:g} s, "
              f"{args.full_mem_gb:g} GB) ...", file=sys.stderr)
        runs.append(run_full_in_child(args.scenario, args.full_timeout, args.full_mem_gb,
                                      lockstep=not args.per_rank))
    if args.full_16k:
        print(f"full fidelity, 16,384 GPUs: running in a child process (limit "
              f"{args.full_16k_timeout:g} s, {args.full_16k_mem_gb:g} GB) ...",
              file=sys.stderr)
        runs.append(run_full_in_child(str(SCENARIO_16K), args.full_16k_timeout,
                                      args.full_16k_mem_gb, "full-16k", not args.per_rank))
    folded = runs[0]
    bare = _mean_bare(bare_before, bare_simpy(repeat=args.repeat))
    for r in runs:  # the targets' figure: CPU seconds in multiples of the bare loop's
        if r.get("status") == "ok":
            r["bare_ratio"] = r["total_cpu_s"] / bare["run_cpu_s"]
    # engine event rate over the bare loop's, by wall clock and by CPU time (the
    # CPU-time ratio is the one to trust when other processes share the cores)
    ratio = {f"{r['fidelity']} ({clock})": r[key] / bare[key]
             for r in runs if r.get("status") == "ok"
             for clock, key in (("wall", "events_per_s"), ("cpu", "events_per_cpu_s"))}
    # the target's figure: engine operations (tasks: a compute op, a collective, a
    # send) per CPU second over bare operations (request/timeout/release cycles)
    ops_ratio = {r["fidelity"]: r["tasks_per_cpu_s"] / bare["cycles_per_cpu_s"]
                 for r in runs if r.get("status") == "ok"}
    by_name = {r["fidelity"]: r for r in runs}
    full = by_name.get("full")
    full_ok = full is not None and full.get("status") == "ok"
    report = {
        "scenario": str(args.scenario),
        "python": platform.python_version(),
        "simpy": simpy.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "pinned_cpu": args.cpu,
        "runs": runs,
        "bare_simpy": bare,
        "rate_ratio": ratio,
        "ops_ratio": ops_ratio,
        "folded_full_step_rel_diff": (abs(full["step_time_s"] - folded["step_time_s"])
                                      / folded["step_time_s"] if full_ok and full else None),
        "targets": TARGETS,
        "targets_met": targets_met(by_name),
    }
    print(table(report))
    if report["folded_full_step_rel_diff"] is not None:
        print(f"folded vs full step time: relative difference "
              f"{report['folded_full_step_rel_diff']:.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

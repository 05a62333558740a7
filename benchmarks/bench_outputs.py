"""Output benchmark: what writing a run directory costs next to simulating the run.

Runs one scenario the way ``clustersim run`` does (``run_scenario`` then
``write_outputs``, default: the bundled GPT-3 175B on 1,024 GPUs with
``--fidelity full``, ten million spans) and reports, in wall and CPU seconds,

- the simulation: building the workload and running the engine;
- the metrics of results.json (report, memory curves), for reference;
- the outputs: the span table, the trace's flows and counters, and writing the
  timeline, trace.json, results.json and the PNGs;

then the outputs' time as a fraction of the simulation's, and for each file
written its bytes and the seconds its write took (the PNGs are drawn together).
Each phase also reports its peak resident memory (the high-water mark is reset as it
starts, Linux only) and what is still resident after it, in MB; the run's peak is the
highest phase's (``/usr/bin/time`` sees only the last reset's).
Targets: outputs at most 20% of the simulation time and under 300 MB in all (issue
"One accounting of the step", item 4); results.json under 1 MB and trace.json
under 50 MB (issue 44, item 3, at the headline scenario, folded or full). Nothing
fails when a target is missed; the figures are printed, each target met or missed,
and, with ``--json``, written.

A full-fidelity 1,024-GPU run needs about 3.2 GB of memory and a few minutes.

Usage::

    python benchmarks/bench_outputs.py                         # GPT-3 1,024 GPUs, full
    python benchmarks/bench_outputs.py --fidelity folded --json out/bench_outputs.json
    python benchmarks/bench_outputs.py --set parallel.dp=1 --set cluster.nodes=16
    python benchmarks/bench_outputs.py --scenario scenarios/llama3-405b-16k-h100.yaml \
        --max-tasks 100000000                                  # 16,384 GPUs: ~7 GB
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = ROOT / "scenarios" / "gpt3-175b-1024.yaml"
TARGETS = {"output_ratio": 0.20, "output_MB": 300.0}
#: Files with a size target of their own: MB at most.
FILE_TARGETS_MB = {"results.json": 1.0, "trace.json": 50.0}
SIMULATION = ("build", "simulate")
#: The phases that make the outputs: these and every ``write_*`` phase.
OUTPUTS = ("span_table", "trace_links")
#: The phase that writes each file (a table's is ``write_table:<file>``).
WRITER = {"timeline.parquet": "write_timeline", "timeline.csv": "write_timeline",
          "trace.json": "write_trace", "results.json": "write_results",
          "timeline.png": "write_plots", "breakdown.png": "write_plots",
          "memory.png": "write_plots", "report.html": "write_report"}


def is_output(phase: str) -> bool:
    return phase in OUTPUTS or phase.startswith("write")


def writer(name: str) -> str:
    return WRITER.get(name, f"write_table:{name}")


def _status_kB(field: str) -> float:
    """A field of /proc/self/status in kB (0 where there is none: not Linux)."""
    try:
        with Path("/proc/self/status").open() as f:
            return next((float(line.split()[1]) for line in f if line.startswith(field)), 0.0)
    except OSError:
        return 0.0


def _reset_peak() -> None:
    """Start a new resident-memory high-water mark (Linux: ``clear_refs`` 5)."""
    with suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


@contextmanager
def _memory_phases(memory: dict[str, dict[str, float]]) -> Iterator[None]:
    """Wrap the API's phase timer so that each phase also records, in MB, its peak
    resident memory (the high-water mark reset as it starts) and what stays resident
    after it."""
    from simulator import api

    timed = api._timed

    @contextmanager
    def measured(timings: Any, phase: str) -> Iterator[None]:
        _reset_peak()
        with timed(timings, phase):
            yield
        peak = max(_status_kB("VmHWM"), memory.get(phase, {}).get("peak_MB", 0.0) * 1e3)
        memory[phase] = {"peak_MB": peak / 1e3, "after_MB": _status_kB("VmRSS") / 1e3}

    api._timed = measured
    try:
        yield
    finally:
        api._timed = timed


def measure(scenario: str, overrides: list[str], fidelity: str, timeline: str,
            trace_ranks: str, out_dir: Path, plots: bool = True,
            max_tasks: int | None = None) -> dict[str, Any]:
    """Run and write once; phase timings and memory, file sizes and the ratios."""
    sys.path.insert(0, str(ROOT))
    from simulator.api import Timings, run_scenario, write_outputs
    from simulator.outputs.rank_selection import parse_rank_selection
    from simulator.spec.load import load_scenario

    s = load_scenario(scenario, overrides)
    timings: Timings = {}
    memory: dict[str, dict[str, float]] = {}
    with _memory_phases(memory):
        run = run_scenario(s, "engine", fidelity, timings=timings, max_tasks=max_tasks,
                           trace_ranks=parse_rank_selection(trace_ranks))
        written = write_outputs(out_dir, run.results, run.spans, timeline=timeline,
                                trace=run.trace, timings=timings, plots=plots)
    files = {p.name: p.stat().st_size for p in written}
    seconds = {name: timings.get(writer(name), (0.0, 0.0)) for name in files}

    def total(phases: list[str], i: int) -> float:
        return sum(timings.get(p, (0.0, 0.0))[i] for p in phases)

    sim_wall, sim_cpu = total(list(SIMULATION), 0), total(list(SIMULATION), 1)
    outputs = [p for p in timings if is_output(p)]
    out_wall, out_cpu = total(outputs, 0), total(outputs, 1)
    return {
        "scenario": s.name, "fidelity": fidelity, "timeline": timeline,
        "trace_ranks": trace_ranks, "spans": 0 if run.spans is None else len(run.spans),
        "phases": {k: {"wall_s": w, "cpu_s": c, **memory.get(k, {})}
                   for k, (w, c) in timings.items()},
        "simulation_s": {"wall": sim_wall, "cpu": sim_cpu},
        "outputs_s": {"wall": out_wall, "cpu": out_cpu},
        "output_ratio": {"wall": out_wall / sim_wall, "cpu": out_cpu / sim_cpu},
        "files_bytes": files, "files_write_s": seconds, "total_bytes": sum(files.values()),
        "file_targets": {name: {"MB": mb, "met": files.get(name, 0) < mb * 1e6}
                         for name, mb in FILE_TARGETS_MB.items() if name in files},
        # the phases reset the high-water mark: the run's peak is the highest of theirs
        "peak_rss_GB": max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                            *(m["peak_MB"] / 1e3 for m in memory.values())]),
        "python": platform.python_version(), "machine": platform.machine(),
    }


def report(r: dict[str, Any]) -> list[str]:
    lines = [f"{r['scenario']} ({r['fidelity']}): {r['spans']:,} spans, timeline "
             f"{r['timeline']}, trace ranks {r['trace_ranks']}",
             f"{'phase':<34}{'wall s':>8}{'cpu s':>8}{'peak MB':>9}{'after MB':>9}"]
    for name, t in r["phases"].items():
        group = "  (simulation)" if name in SIMULATION else "  (output)" if is_output(name) \
            else "  (results.json figures)"
        lines.append(f"{name:<34}{t['wall_s']:>8.2f}{t['cpu_s']:>8.2f}"
                     f"{t.get('peak_MB', 0):>9,.0f}{t.get('after_MB', 0):>9,.0f}{group}")
    ratio = r["output_ratio"]
    mb = r["total_bytes"] / 1e6
    lines += [
        f"outputs / simulation: {ratio['wall']:.1%} wall, {ratio['cpu']:.1%} CPU "
        f"(target <= {TARGETS['output_ratio']:.0%}: "
        f"{'met' if ratio['cpu'] <= TARGETS['output_ratio'] else 'missed'} by CPU time)",
        f"bytes written: {mb:,.1f} MB (target < {TARGETS['output_MB']:.0f} MB: "
        f"{'met' if mb < TARGETS['output_MB'] else 'missed'})",
        f"  {'file':<24}{'MB':>10}{'wall s':>8}{'cpu s':>8}  (its write)",
        *(f"  {name:<24}{size / 1e6:>10.3f}{r['files_write_s'][name][0]:>8.2f}"
          f"{r['files_write_s'][name][1]:>8.2f}"
          + (" (the PNGs together)" if writer(name) == "write_plots" else "")
          for name, size in r["files_bytes"].items()),
        *(f"{name} under {t['MB']:g} MB: {'met' if t['met'] else 'missed'} "
          f"({r['files_bytes'][name] / 1e6:,.3f} MB)" for name, t in r["file_targets"].items()),
        f"peak memory: {r['peak_rss_GB']:.1f} GB",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default=str(DEFAULT_SCENARIO))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--fidelity", choices=["folded", "full"], default="full")
    p.add_argument("--timeline", choices=["parquet", "csv", "both"], default="parquet")
    p.add_argument("--trace-ranks", default="stages")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--max-tasks", type=int, default=None,
                   help="as clustersim run's (the 16,384-GPU scenario at full fidelity "
                   "needs 100000000)")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory to write (default: a temporary one, removed)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_outputs_") as tmp:
        out = args.out or Path(tmp)
        r = measure(args.scenario, args.overrides, args.fidelity, args.timeline,
                    args.trace_ranks, out, plots=not args.no_plots,
                    max_tasks=args.max_tasks)
    print("\n".join(report(r)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measured versus simulated: ``clustersim compare DIR --profile PROFILE.yaml``.

Takes the output of ``clustersim measure`` (``measured.json``, ``scenario.yaml``,
the per-rank profiler traces), simulates that scenario with the given hardware
profile (full fidelity: every rank, as measured) and puts the figures side by
side, each with its relative error (simulated − measured) / measured:

- ``step_time_s``: the median measured step against the simulated step.
- ``compute_s``: forward + backward busy time per rank, mean over ranks. The
  measured figure comes from one profiled step. On a CPU the profiler's overhead
  stretches the ``aten::`` operators that are the compute there, so it is rescaled by
  median step / profiled step; on a GPU the compute is the kernels' time on the
  device (CUPTI's timestamps), which the profiler's host overhead does not stretch
  (it only widens the gaps between kernels), so it is taken as it is.
- ``non_compute_s``: step time minus compute and optimizer, mean over ranks —
  the time a rank waits for communication or sits in the pipeline bubble (the
  simulated side sums the accounting's communication and idle categories). On
  CPU, gloo's blocking receives make exposed communication and bubble
  indistinguishable in the measured trace, so they are compared together.
- ``idle_fraction``: non-compute time / step time.
- ``state_bytes``: weights + gradients + optimizer states per rank (the largest
  rank), measured from the live tensors, simulated by ``memory.py``. Process RSS
  is recorded in ``measured.json`` but not compared: on CPU it is mostly the
  interpreter and PyTorch.
- ``peak_reserved_bytes`` (CUDA runs): the caching allocator's peak
  (``torch.cuda.max_memory_reserved``, the largest rank) against the simulated peak
  less the memory outside that allocator (``device``: the CUDA context and NCCL's
  buffers, :mod:`simulator.model.device_memory`); n/a on CPU.

A run with a straggler on purpose (``measure --slow-rank R --slowdown K``) is
simulated with the slowdown its rank actually ran with, where ``measured.json`` says
what it slept per timed step (:func:`slowdown_as_slept`): K − 1 times each piece's time
asked of ``time.sleep``, plus the sleeps' overshoot, of pieces that hold more than
compute, plus what its pieces took beyond their time in steps without sleeps (the
caches it woke to; :mod:`calibration.measured.slow_rank`).

Writes ``DIR/comparison.json`` and ``DIR/comparison.png`` (both timelines, one
above the other, on one time axis) atomically.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from simulator.analysis.accounting.metrics import mean_breakdown
from simulator.analysis.accounting.vocabulary import COMPUTE_CATEGORIES
from simulator.errors import Problem, UserError

FIGURES = ("step_time_s", "compute_s", "non_compute_s", "idle_fraction", "state_bytes",
           "peak_reserved_bytes")
#: figures in bytes (printed in MB)
BYTE_FIGURES = ("state_bytes", "peak_reserved_bytes")


def measured_figures(measured: dict[str, Any]) -> dict[str, float]:
    step = float(measured["step_time_s"])
    ranks = measured.get("per_rank") or [measured]
    on_device = measured.get("device") == "cuda"  # kernel times: not profiler-stretched
    compute, other = [], []
    for r in ranks:
        scale = 1.0 if on_device else step / float(r.get("profiled_step_s") or step)
        c = float(r["compute_s"]) * scale
        o = float(r.get("optimizer_s", 0.0)) * scale
        compute.append(c)
        other.append(max(step - c - o, 0.0))
    nc = sum(other) / len(other)
    return {"step_time_s": step, "compute_s": sum(compute) / len(compute),
            "non_compute_s": nc, "idle_fraction": nc / step,
            "state_bytes": float(max(measured.get("state_bytes") or [0])),
            "peak_reserved_bytes": float(max(
                [b for b in measured.get("peak_reserved_bytes") or [] if b] or [0]))}


def simulated_figures(results: dict[str, Any]) -> dict[str, float]:
    """The figures of a simulated run, from the accounting's per-rank breakdown: compute
    is the forward, backward and recompute categories, non-compute every category but
    those and the optimizer (communication, peer-waits and idle), mean over ranks."""

    step = float(results["step_time_s"])
    mean = mean_breakdown(results["time_breakdown_s"])
    compute = sum(mean[c] for c in COMPUTE_CATEGORIES if c != "optimizer")
    nc = step - compute - mean["optimizer"]
    state = max(m["weights"] + m["gradients"] + m["optimizer"] for m in results["memory"])
    reserved = max(m["total"] - m.get("device", 0.0) for m in results["memory"])
    return {"step_time_s": step, "compute_s": compute, "non_compute_s": nc,
            "idle_fraction": nc / step, "state_bytes": float(state),
            "peak_reserved_bytes": float(reserved)}


def relative_errors(meas: dict[str, float], sim: dict[str, float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in FIGURES:
        m, s = meas.get(k), sim.get(k)
        out[k] = None if not m or s is None else (s - m) / m
    return out


def compare(run_dir: Path, profile: Path | str,
            step_time_s: float | None = None) -> dict[str, Any]:
    """Simulate the measured scenario with ``profile``; return the comparison dict.
    ``step_time_s`` stands for the run's median step where the caller pooled several
    runs of the scenario (the validation's repeats); this run's trace still gives the
    compute and idle shares."""
    from simulator.outputs.run_files import read_measured

    measured = read_measured(run_dir / "measured.json")  # before importing pandas
    if step_time_s is not None:
        measured = {**measured, "step_time_s": float(step_time_s)}
    from simulator.api import simulate_scenario
    from simulator.spec.load import load_scenario

    if not (run_dir / "scenario.yaml").exists():
        raise UserError([Problem("run_dir", str(run_dir), "has no scenario.yaml")])
    system = str(Path(profile).resolve()) if str(profile).endswith((".yaml", ".yml")) \
        else str(profile)
    overrides = [f"cluster.system={system}"]
    slept = slowdown_as_slept(run_dir / "scenario.yaml", overrides, measured)
    if slept is not None:  # the straggler as it ran
        overrides.append(f"variability.slow_gpus=[{{ranks: [{slept[0]}], "
                         f"compute_slowdown: {slept[1]:.6g}}}]")
    scenario = load_scenario(run_dir / "scenario.yaml", overrides)
    results, spans = simulate_scenario(scenario, "engine", "full")
    meas, sim = measured_figures(measured), simulated_figures(results)
    return {"run_dir": str(run_dir), "profile": system,
            "slowdown_as_slept": None if slept is None else {
                "rank": slept[0], "compute_slowdown": slept[1]},
            "device": str(measured.get("device", "cpu")),  # whose trace events are compute
            "scenario": scenario.to_dict(),
            "measured": meas, "simulated": sim, "relative_error": relative_errors(meas, sim),
            # the measured step: this run's median, or several runs' pooled (validation)
            "measured_step_pooled": step_time_s is not None,
            "simulated_results": {k: results[k] for k in ("bubble_fraction", "exposed_comm_s",
                                                          "mfu", "sim_wall_s")},
            "_spans": spans}


def slowdown_as_slept(path: Path, overrides: list[str], measured: dict[str, Any],
                      ) -> tuple[int, float] | None:
    """(rank, slowdown) of the scenario's one straggler as the measured run slept it, or
    None (no straggler, or a ``measured.json`` without ``slowdown_step_slept_s``).

    The rank slept s seconds in a median timed step and its pieces took w seconds more
    than in its awake warm-up steps (the cold caches it woke to after each sleep,
    :mod:`calibration.measured.slow_rank`; 0 where ``measured.json`` has no piece times);
    simulated without the straggler it computes c seconds a step (every compute
    category, the optimizer's too: the sleeps follow the optimizer step as well), so
    the slowdown that adds exactly s + w is 1 + (s + w) / c."""
    from simulator.api import simulate_scenario
    from simulator.spec.load import load_scenario

    slow = load_scenario(path, overrides).variability.slow_gpus
    if len(slow) != 1 or not slow[0].ranks or len(slow[0].ranks) != 1:
        return None
    rank = slow[0].ranks[0]
    mine: dict[str, Any] = next(
        (r for r in measured.get("per_rank") or [] if r.get("rank") == rank), {})
    slept = mine.get("slowdown_step_slept_s")
    if slept is None:
        return None
    if mine.get("slowdown_awake_piece_s") is not None:  # the wake-up cost
        slept += mine["slowdown_step_piece_s"] - mine["slowdown_awake_piece_s"]
    base = load_scenario(path, [*overrides, "variability.slow_gpus=[]"])
    results, _ = simulate_scenario(base, "engine", "full")
    compute = sum(results["time_breakdown_s"][rank][c] for c in COMPUTE_CATEGORIES)
    return (rank, 1.0 + float(slept) / compute) if compute > 0 else None


def table_lines(comparison: dict[str, Any]) -> list[str]:
    rows = [("figure", "measured", "simulated", "error")]
    for k in FIGURES:
        m, s = comparison["measured"][k], comparison["simulated"][k]
        e = comparison["relative_error"][k]
        fmt = (lambda v: f"{v / 1e6:.2f} MB" if v else "n/a") if k in BYTE_FIGURES else (
            (lambda v: f"{v:.1%}") if k == "idle_fraction" else (lambda v: f"{v * 1e3:.2f} ms"))
        rows.append((k, fmt(m), fmt(s), "n/a" if e is None else f"{e:+.1%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _measured_rows(run_dir: Path, device: str) -> list[tuple[int, list[tuple[float, float]],
                                                             list[tuple[float, float]]]]:
    from calibration.measured.measure_trace import trace_intervals
    from simulator.loading import read_json

    rows = []
    for path in sorted((run_dir / "traces").glob("trace_rank*.json")):
        rank = int(path.stem.removeprefix("trace_rank"))
        iv = trace_intervals(read_json(path, "run_dir"), device)
        rows.append((rank, iv["work"], iv["comm"]))
    t0 = min((iv[0][0] for _, w, c in rows for iv in (w, c) if iv), default=0.0)
    return [(r, [((a - t0) * 1e-6, (b - t0) * 1e-6) for a, b in w],
             [((a - t0) * 1e-6, (b - t0) * 1e-6) for a, b in c]) for r, w, c in rows]


def plot_comparison(run_dir: Path, comparison: dict[str, Any], path: Path) -> None:
    """Measured (profiled step) above simulated, compute and communication per rank."""
    from matplotlib.figure import Figure

    from simulator.outputs.trace_export import atomic_output

    spans = comparison["_spans"]
    device = "cuda" if "cuda" in str(comparison.get("device", "")) else "cpu"
    measured = _measured_rows(run_dir, device)
    fig = Figure(figsize=(12, 2.0 + 0.9 * (len(measured) + spans["rank"].nunique())))
    axes = fig.subplots(2, 1, sharex=True)
    for rank, work, comm in measured:
        axes[0].broken_barh([(a, b - a) for a, b in work], (rank - 0.4, 0.5), color="#4c78a8")
        axes[0].broken_barh([(a, b - a) for a, b in comm], (rank + 0.15, 0.25), color="#54a24b")
    from simulator.analysis.accounting.vocabulary import COMM_KINDS

    for rank, group in spans.groupby("rank"):
        is_comm = group["kind"].isin(COMM_KINDS)
        busy = group[~is_comm & (group["stream"] == "compute")]
        comm = group[is_comm]
        axes[1].broken_barh(list(zip(busy["start"], busy["end"] - busy["start"], strict=True)),
                            (rank - 0.4, 0.5), color="#4c78a8")
        axes[1].broken_barh(list(zip(comm["start"], comm["end"] - comm["start"], strict=True)),
                            (rank + 0.15, 0.25), color="#54a24b")
    m, s = comparison["measured"]["step_time_s"], comparison["simulated"]["step_time_s"]
    axes[0].set_title(f"measured (one profiled step; median step {m * 1e3:.1f} ms)")
    axes[1].set_title(f"simulated ({s * 1e3:.1f} ms)")
    ranks = sorted(spans["rank"].unique())
    for ax in axes:
        ax.set_yticks(ranks)
        ax.set_ylabel("rank")
        ax.set_xlabel("time (s)")
        ax.invert_yaxis()
    fig.legend(handles=[_patch("#4c78a8", "compute"), _patch("#54a24b", "communication")],
               loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def _patch(color: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def write_comparison(run_dir: Path, comparison: dict[str, Any]) -> Path:
    from simulator.outputs.trace_export import atomic_output

    clean = {k: v for k, v in comparison.items() if not k.startswith("_")}
    path = run_dir / "comparison.json"
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    return path


def run_compare(run_dir: Path, profile: str, plot: bool = True,
                step_time_s: float | None = None) -> dict[str, Any]:
    comparison = compare(run_dir, profile, step_time_s)
    for k, v in comparison["simulated"].items():
        if not math.isfinite(v):
            raise RuntimeError(f"simulated {k} is not finite: {v}")
    write_comparison(run_dir, comparison)
    if plot:
        plot_comparison(run_dir, comparison, run_dir / "comparison.png")
    return comparison


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "compare", help="simulate a measured run's scenario and compare with the measurement",
        description="Simulate the scenario of a `clustersim measure` directory with a hardware "
        "profile and print measured versus simulated figures with their errors.",
        epilog="example:\n  clustersim calibrate --device cpu --quick --out cpu.yaml\n"
        "  clustersim measure --tp 1 --pp 2 --dp 1 --steps 5 --device cpu --out runs/pp2\n"
        "  clustersim compare runs/pp2 --profile cpu.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="output directory of `clustersim measure`")
    p.add_argument("--profile", required=True,
                   help="hardware profile YAML (from `clustersim calibrate`) or preset name")
    p.add_argument("--no-plot", action="store_true", help="skip comparison.png")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    comparison = run_compare(args.run_dir, args.profile, plot=not args.no_plot)
    print("\n".join(table_lines(comparison)))
    print(f"wrote {args.run_dir / 'comparison.json'}")
    return 0

"""Report: metrics from a finished simulation (or an analytic estimate).

Every time category comes from :mod:`simulator.analysis.accounting` (docs/outputs.md,
"The accounting"): ``time_breakdown_s`` per simulated rank, ``step_breakdown_s`` their
mean, ``critical_path_s``; ``bubble_fraction`` is the mean pipeline bubble over
ranks as a fraction of the pipeline phase (first forward to last backward).
``exposed_comm_s`` per kind is the mean transfer + peer-wait time that held a
rank back; ``compute_s`` per stage is the mean compute and optimizer time.

- MFU / HFU: model / hardware FLOPs per second per GPU over the dense peak of
  the training dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from simulator.analysis.accounting.breakdown import breakdown
from simulator.analysis.accounting.critical_path import (
    composition,
    critical_path,
    merge_segments,
)
from simulator.analysis.accounting.metrics import metrics
from simulator.analysis.accounting.timing import Timing
from simulator.analysis.accounting.vocabulary import categories, label
from simulator.analysis.memory import memory_report
from simulator.builder.columns import TaskColumns, task_columns
from simulator.builder.tasks import Workload
from simulator.engine.result import SimResult
from simulator.model import transformer as mdl
from simulator.outputs.span_table import span_table
from simulator.spec.recompute import flops_modes, policy
from simulator.spec.scenario import Scenario
from simulator.strategies.compression import arithmetic as cmp
from simulator.system.collectives.plan import busbw_factor
from simulator.system.costs import CostModel


def spans_frame(result: SimResult) -> pd.DataFrame:
    """One row per span, sorted by (rank, start):
    :func:`simulator.outputs.span_table.span_table`."""
    return span_table(result)


def collective_summary(columns: TaskColumns, timing: Timing) -> dict[str, dict[str, Any]]:
    """Per collective (e.g. ``tp.all_reduce``): count, bytes, seconds, and the mean
    algbw / busbw in GB/s with nccl-tests' definitions (algbw = S / t, busbw = algbw
    × 2(n − 1)/n for all-reduce, × (n − 1)/n for all-gather and reduce-scatter), t
    from the moment the whole group had arrived (time waiting for peers excluded);
    ``algorithms``: how many ran as each ``algorithm/protocol`` (e.g. ``ring/LL``)."""
    ids, plans = columns.plan_ids, columns.plans
    if not len(ids):
        return {}
    # by codes, not a string per collective (millions at full fidelity): the op as a
    # categorical in name order (groups as strings sort), the algorithm as an index
    factors: dict[int, float] = {}
    algorithm: dict[int, int] = {}
    names: dict[str, int] = {}
    for plan in plans:
        if id(plan) not in factors:
            factors[id(plan)] = busbw_factor(plan.op, plan.n)
            name = f"{plan.algorithm}/{plan.protocol}"
            algorithm[id(plan)] = names.setdefault(name, len(names))
    ops = columns.values["op"]
    by_name = sorted(range(len(ops)), key=ops.__getitem__)
    position = np.empty(len(ops), dtype=np.int32)
    position[by_name] = np.arange(len(ops), dtype=np.int32)
    frame = pd.DataFrame({
        "op": pd.Categorical.from_codes(position[columns.codes["op"][ids]],
                                        [ops[i] for i in by_name]),
        "bytes": columns.numbers["nbytes"][ids],
        "seconds": timing.end_a[ids] - timing.begin_a[ids],
        "factor": np.fromiter((factors[id(p)] for p in plans), float, len(plans)),
        "algorithm": np.fromiter((algorithm[id(p)] for p in plans), np.int32, len(plans))},
        copy=False)
    frame = frame[frame["seconds"] > 0]
    frame["algbw"] = frame["bytes"] / frame["seconds"]
    frame["busbw"] = frame["algbw"] * frame["factor"]
    labels = list(names)
    out = {}
    for op, g in frame.groupby("op", sort=True, observed=True):
        used, first, counts = np.unique(g["algorithm"].to_numpy(), return_index=True,
                                        return_counts=True)
        out[str(op)] = {"count": float(len(g)), "bytes": float(g["bytes"].sum()),
                        "seconds": float(g["seconds"].sum()),
                        "algbw_GBps": float(g["algbw"].mean()) / 1e9,
                        "busbw_GBps": float(g["busbw"].mean()) / 1e9,
                        "algorithms": {labels[used[i]]: float(counts[i])  # as they first ran
                                       for i in np.argsort(first, kind="stable")}}
    return out


def _last(w: Workload, timing: Timing) -> int:
    """The task that ends the step (one on a compute stream when several end together)."""
    ends = timing.end_a
    candidates = np.flatnonzero(ends == ends.max()).tolist()
    return next((i for i in candidates if w.tasks[i].stream == "compute"), candidates[0])


def engine_metrics(s: Scenario, result: SimResult,
                   columns: TaskColumns | None = None) -> dict[str, Any]:
    """Step time, throughput, the accounting's breakdown and critical path, from the spans
    (``columns``: the workload's :func:`~simulator.builder.columns.task_columns`, read
    here when not given)."""
    w = result.workload
    columns = columns if columns is not None else task_columns(w)
    timing = Timing.of(w.tasks, result.start, result.end, result.begin, result.last,
                       columns.prev)
    step = result.end_time
    ranks = list(w.programs)
    stage_of = {r: w.layout.coord(r).pp for r in ranks}
    # a data-parallel replica's pipeline: its TP ranks leave each stage together, and
    # its drain ends with the last of them (a straggler's TP peers wait for it)
    pipeline_of = {r: w.layout.coord(r).dp for r in ranks}
    entries, bubbles, phase = breakdown(timing, columns, ranks, stage_of, pipeline_of, step,
                                        s.parallel.schedule, s.parallel.pp,
                                        s.microbatches, s.parallel.virtual_stages)
    if w.weights is not None:  # asymmetric folding: an entry stands for its class
        for e in entries:
            e["ranks"] = int(w.weights[e["rank"]])
    out = metrics(entries, step, phase, bubbles)
    if len(result.start):
        out["critical_path"] = merge_segments(critical_path(timing, _last(w, timing),
                                                                    step))
        out["critical_path_s"] = composition(out["critical_path"])
    out.update({
        "link_busy_s": result.link_busy,
        "collectives": collective_summary(columns, timing),
        "sim_wall_s": result.wall_s,
        "sim_events": result.events,
        "ranks_simulated": len(w.programs),
        "fidelity": w.fidelity,
    })
    if result.lockstep_groups:  # full fidelity, one process per TP group
        out["lockstep_groups"] = result.lockstep_groups
    return out


def common_metrics(s: Scenario, step_time: float) -> dict[str, Any]:
    """Throughput, FLOP rates and memory: the same for every method."""
    world = s.parallel.world
    # a mixed-generation cluster: the mean of its GPUs' peaks (stages hold equal counts)
    peak = sum(s.hardware_of_stage(st).gpu.peak_flops(s.training.dtype)
               for st in range(s.parallel.pp)) / s.parallel.pp if s.stage_hardware \
        else s.hardware.gpu.peak_flops(s.training.dtype)
    model_flops = mdl.model_flops_per_step(s.model, s.training.global_batch)
    modes = flops_modes(s.parallel, s.model.layers, s.model.mtp_layers)
    hw_flops = mdl.hardware_flops_per_step(s.model, s.training.global_batch, policy(s.parallel),
                                           modes, s.stack)
    model_tflops = model_flops / step_time / world / 1e12
    hw_tflops = hw_flops / step_time / world / 1e12
    stages = memory_report(s)
    peak_mem = max(stages, key=lambda m: m.total)
    return {
        "tokens_per_s": s.training.global_batch * s.model.seq_len / step_time,
        "model_tflops_per_gpu": model_tflops,
        "hardware_tflops_per_gpu": hw_tflops,
        "mfu": model_tflops * 1e12 / peak,
        "hfu": hw_tflops * 1e12 / peak,
        "microbatches": s.microbatches,
        "memory_peak_bytes": peak_mem.total,
        "fits_in_memory": all(m.fits for m in stages),
        "memory": [{"stage": m.stage, "weights": m.weights, "gradients": m.gradients,
                    "optimizer": m.optimizer, "activations": m.activations,
                    "logits": m.logits, "comm_buffers": m.comm_buffers, "device": m.runtime,
                    "total": m.total,
                    "capacity": m.capacity} for m in stages],
        "gradient_compression": cmp.traffic(s),
        "rank_stretch": rank_stretch(s),
    }


def rank_stretch(s: Scenario) -> dict[str, Any]:
    """How many times as long every op takes at the slowest of the step's ranks, and
    from which term: the profile's population curve (``gpu.rank_excess``), its spread
    (``gpu.rank_spread`` · e_n), or none."""
    cost = CostModel(s.hardware, s.training.dtype, ranks=s.parallel.world)
    return {"factor": cost.rank_stretch, "ranks": cost.ranks, "term": cost.rank_term}


#: A category whose share of the step is at least this is named in the summary.
SHOWN_SHARE = 0.02


def shares_text(seconds: dict[str, float], step: float) -> str:
    """Every category at or above :data:`SHOWN_SHARE` of the step, in the vocabulary's
    order (the same for every line), then what the smaller ones add up to."""
    if step <= 0:
        return ""
    order = {c: i for i, c in enumerate(categories())}
    ranked = sorted(seconds, key=lambda c: order.get(c, len(order)))
    shown = [c for c in ranked if seconds[c] >= SHOWN_SHARE * step]
    rest = sum(v for c, v in seconds.items() if c not in shown and v > 0)
    parts = [f"{label(c)} {seconds[c] / step:.1%}" for c in shown]
    if rest > 0:
        parts.append(f"(others {rest / step:.1%})")
    return "  ".join(parts)


def summary_lines(results: dict[str, Any], wall: dict[str, float] | None = None) -> list[str]:
    """The short console table; ``wall``: the run's wall seconds by phase (build,
    simulate, write ...), when the caller timed them."""
    gb = 1e9
    rows = [
        ("scenario", results["scenario"]["name"]),
        ("method", f"{results['method']}" + (f" ({results['fidelity']})"
                                             if results.get("fidelity") else "")),
        ("step time", f"{results['step_time_s']:.4g} s"),
        ("tokens/s", f"{results['tokens_per_s']:,.0f}"),
        ("model TFLOP/s/GPU", f"{results['model_tflops_per_gpu']:.1f}  (MFU {results['mfu']:.1%})"),
        ("hardware TFLOP/s/GPU",
         f"{results['hardware_tflops_per_gpu']:.1f}  (HFU {results['hfu']:.1%})"),
        ("bubble", f"{results['bubble_fraction']:.2%} of the pipeline phase"),
    ]
    mean = results.get("step_breakdown_s") or {}
    if mean:
        rows.append(("where the step goes", shares_text(mean, results["step_time_s"])))
    path = results.get("critical_path_s") or {}
    if path:
        rows.append(("critical path", shares_text(path, results["step_time_s"])))
    comp = results.get("gradient_compression") or {}
    if comp.get("method", "none") != "none":
        gb_wire = comp["wire_bytes_per_gpu"] / 1e9
        state = "compressed" if comp["compressed_step"] else "warm-up, uncompressed"
        rows.append(("gradient compression",
                     f"{comp['method']} ({state}): {gb_wire:.3g} GB on the wire per GPU, "
                     f"{comp['saved_fraction']:.1%} less than uncompressed; kernels "
                     f"{comp['compression_compute_s'] * 1e3:.3g} ms"))
    stretch = results.get("rank_stretch") or {}
    if stretch.get("factor", 1.0) > 1.0:
        rows.append(("slowest rank", f"every op {stretch['factor']:.3f}× as long: the slowest "
                                     f"of {stretch['ranks']:,} GPUs (gpu.{stretch['term']})"))
    verdict = "fits" if results["fits_in_memory"] else "DOES NOT FIT"
    cap = results["memory"][0]["capacity"]
    rows.append(("peak memory", f"{results['memory_peak_bytes'] / gb:.1f} GB of "
                                f"{cap / gb:.0f} GB  ({verdict})"))
    if "sim_wall_s" in results:
        groups = results.get("lockstep_groups") or 0
        rows.append(("simulation", f"{results['ranks_simulated']} ranks simulated"
                                   + (f" in {groups} lock-step groups" if groups else "")
                                   + f", {results['sim_events']:,} events "
                                   f"(SimPy's run {results['sim_wall_s']:.2f} s)"))
    if wall:
        rows.append(("wall time", "  ".join(f"{k} {v:.2f} s" for k, v in wall.items())
                     + f"  (total {sum(wall.values()):.2f} s)"))
    width = max(len(k) for k, _ in rows)
    return [line for k, v in rows for line in _wrapped(f"{k:<{width}}  ", v)]


def _wrapped(head: str, text: str, width: int = 100) -> list[str]:
    """``head`` then ``text``, broken between its two-space-separated parts at ``width``
    with the continuation lines indented under the first."""
    lines, line = [], head
    for part in text.split("  "):
        if line.strip() and len(line) + len(part) > width and line != head:
            lines.append(line.rstrip())
            line = " " * len(head)
        line += part + "  "
    return [*lines, line.rstrip()]

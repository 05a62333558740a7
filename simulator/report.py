"""Report: metrics from a finished simulation (or an analytic estimate).

Definitions (README "Reading the outputs"):

- *pipeline phase*: from the first forward's start to the last backward's (or
  weight-gradient's) end; the optimizer step and any gradient-sync tail after it
  are reported separately.
- *bubble fraction* = 1 − (compute-busy time of all stages in the pipeline
  phase) / (p × the phase's duration), so balanced stages with free
  communication give exactly (p − 1)/(m + p − 1). Per stage: 1 − busy / phase.
  A stage's figures are the mean over its simulated ranks. Communication on the
  compute stream (TP collectives) is not compute, so it raises this figure;
  *pipeline idle fraction* counts it as busy, leaving the schedule's own idle
  time (fill, drain, waits for transfers).
- *exposed communication* per kind: TP collectives and any communication run on
  the compute stream count whole; communication on its own stream counts for
  the part of it during which the compute stream sat idle waiting for it.
- MFU / HFU: model / hardware FLOPs per second per GPU over the dense peak of
  the training dtype.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd

from simulator import memory as mem
from simulator import model as mdl
from simulator.collectives import busbw_factor
from simulator.engine import SimResult
from simulator.scenario import Scenario
from simulator.tasks import Task

COMPUTE_KINDS = frozenset({"forward", "backward", "weight_grad", "recompute"})
COMM_KINDS = ("tp", "pp", "dp", "zero", "embedding_tie")
SPAN_COLUMNS = ["rank", "stage", "tp", "dp", "stream", "op", "kind", "name", "microbatch",
                "layer", "chunk", "start", "end", "bytes"]


def spans_frame(result: SimResult) -> pd.DataFrame:
    """One row per span, sorted by (rank, start)."""
    tasks, layout = result.workload.tasks, result.workload.layout
    rows = []
    for tid, start, end in result.spans:
        t = tasks[tid]
        c = layout.coord(t.rank)
        rows.append((t.rank, c.pp, c.tp, c.dp, t.stream, t.op, t.kind, t.name, t.microbatch,
                     t.layer, t.chunk, start, end, t.nbytes))
    df = pd.DataFrame(rows, columns=SPAN_COLUMNS)
    return df.sort_values(["rank", "start", "end"], kind="stable").reset_index(drop=True)


def _exposed(tasks: list[Task], compute: list[tuple[Task, float, float]],
             where: dict[int, tuple[float, float]]) -> dict[str, float]:
    """Exposed communication of one rank, by kind."""
    out: dict[str, float] = defaultdict(float)
    prev_end = 0.0
    for task, start, end in compute:
        if task.kind in COMM_KINDS:
            out[task.kind] += end - start
        elif start > prev_end:
            for d in task.deps:
                dep = tasks[d]
                if dep.kind in COMM_KINDS and dep.stream != "compute":
                    s, e = where[d]
                    out[dep.kind] += max(0.0, min(e, start) - max(s, prev_end))
        prev_end = max(prev_end, end)
    return out


def collective_summary(result: SimResult) -> dict[str, dict[str, float]]:
    """Per collective (e.g. ``tp.all_reduce``): count, bytes, seconds, and the mean
    algbw / busbw in GB/s with nccl-tests' definitions (algbw = S / t, busbw = algbw
    × 2(n − 1)/n for all-reduce, × (n − 1)/n for all-gather and reduce-scatter), t
    from the moment the whole group had arrived (time waiting for peers excluded)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])
    for tid, start, end in result.spans:
        t = result.workload.tasks[tid]
        begin = result.comm_start.get(tid, start)
        if t.plan is None or end <= begin:
            continue
        a = acc[t.op]
        alg = t.nbytes / (end - begin)
        a[0] += 1
        a[1] += t.nbytes
        a[2] += end - begin
        a[3] += alg
        a[4] += alg * busbw_factor(t.plan.op, t.plan.n)
    return {op: {"count": a[0], "bytes": a[1], "seconds": a[2], "algbw_GBps": a[3] / a[0] / 1e9,
                 "busbw_GBps": a[4] / a[0] / 1e9} for op, a in sorted(acc.items())}


def engine_metrics(s: Scenario, result: SimResult) -> dict[str, Any]:
    """Step time, throughput, bubble and exposed communication from the spans."""
    tasks, layout = result.workload.tasks, result.workload.layout
    where = {tid: (a, b) for tid, a, b in result.spans}
    per_rank: dict[int, list[tuple[Task, float, float]]] = defaultdict(list)
    for tid, a, b in result.spans:
        if tasks[tid].stream == "compute":
            per_rank[tasks[tid].rank].append((tasks[tid], a, b))
    phase_spans = [(a, b) for tid, a, b in result.spans if tasks[tid].kind in COMPUTE_KINDS]
    p0 = min((a for a, _ in phase_spans), default=0.0)
    p1 = max((b for _, b in phase_spans), default=0.0)
    phase = max(p1 - p0, 1e-30)
    pp = s.parallel.pp
    busy_stage, compute_stage, occupied_stage = [0.0] * pp, [0.0] * pp, [0.0] * pp
    exposed_stage: list[dict[str, float]] = [defaultdict(float) for _ in range(pp)]
    ranks_stage = [0] * pp
    for rank, spans in per_rank.items():
        st = layout.coord(rank).pp
        ranks_stage[st] += 1
        spans.sort(key=lambda x: (x[1], x[2]))
        busy_stage[st] += sum(b - a for t, a, b in spans if t.kind in COMPUTE_KINDS)
        occupied_stage[st] += sum(
            max(0.0, min(b, p1) - max(result.comm_start.get(t.id, a), p0))
            for t, a, b in spans if t.kind in COMPUTE_KINDS or t.kind in COMM_KINDS)
        compute_stage[st] += sum(b - a for t, a, b in spans
                                 if t.kind in COMPUTE_KINDS or t.kind == "optimizer")
        for k, v in _exposed(tasks, spans, where).items():
            exposed_stage[st][k] += v
    n = [max(c, 1) for c in ranks_stage]
    busy = [busy_stage[i] / n[i] for i in range(pp)]
    exposed = {k: sum(exposed_stage[i][k] / n[i] for i in range(pp)) / pp for k in COMM_KINDS}
    return {
        "step_time_s": result.end_time,
        "bubble_fraction": 1.0 - sum(busy) / (pp * phase),
        "bubble_fraction_per_stage": [1.0 - b / phase for b in busy],
        # the schedule's own idle time: communication that occupies the compute stream
        # (TP collectives, sends without overlap) counts as busy here
        "pipeline_idle_fraction": 1.0 - sum(occupied_stage[i] / n[i] for i in range(pp))
        / (pp * phase),
        "pipeline_phase_s": [p0, p1],
        "compute_s": [compute_stage[i] / n[i] for i in range(pp)],
        "exposed_comm_s": exposed,
        "exposed_comm_s_per_stage": [{k: exposed_stage[i][k] / n[i] for k in COMM_KINDS}
                                     for i in range(pp)],
        "link_busy_s": result.link_busy,
        "collectives": collective_summary(result),
        "sim_wall_s": result.wall_s,
        "sim_events": result.events,
        "ranks_simulated": len(result.workload.programs),
        "fidelity": result.workload.fidelity,
    }


def common_metrics(s: Scenario, step_time: float) -> dict[str, Any]:
    """Throughput, FLOP rates and memory: the same for every method."""
    world = s.parallel.world
    peak = s.hardware.gpu.peak_flops(s.training.dtype)
    model_flops = mdl.model_flops_per_step(s.model, s.training.global_batch)
    hw_flops = mdl.hardware_flops_per_step(s.model, s.training.global_batch, s.parallel.recompute)
    model_tflops = model_flops / step_time / world / 1e12
    hw_tflops = hw_flops / step_time / world / 1e12
    stages = mem.memory_report(s)
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
                    "logits": m.logits, "comm_buffers": m.comm_buffers, "total": m.total,
                    "capacity": m.capacity} for m in stages],
    }


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The short console table."""
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
        ("bubble", f"{results['bubble_fraction']:.2%}" + (
            f"  (pipeline idle {results['pipeline_idle_fraction']:.2%}, TP counted busy)"
            if "pipeline_idle_fraction" in results else "")),
    ]
    exposed = results.get("exposed_comm_s") or {}
    if exposed:
        rows.append(("exposed comm", "  ".join(f"{k} {v:.3g}s" for k, v in exposed.items())))
    verdict = "fits" if results["fits_in_memory"] else "DOES NOT FIT"
    cap = results["memory"][0]["capacity"]
    rows.append(("peak memory", f"{results['memory_peak_bytes'] / gb:.1f} GB of "
                                f"{cap / gb:.0f} GB  ({verdict})"))
    if "sim_wall_s" in results:
        rows.append(("simulation", f"{results['sim_wall_s']:.2f} s wall, "
                                   f"{results['sim_events']:,} events, "
                                   f"{results['ranks_simulated']} ranks simulated"))
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]

"""``clustersim calibrate``: measure this machine and write a hardware profile.

The profile has the schema of the bundled presets, so a scenario uses it with
``cluster.system: path/to/profile.yaml``. What is measured:

- GEMMs from the bundled models' layers (several TP degrees and micro-batch
  sizes; scaled down on a CPU) plus a grid, in the chosen dtype → peak FLOP/s
  and ``gemm_efficiency``; a few of them in the other dtypes → their peaks; a
  spread of them in the backward layouts (dY·Wᵀ, Xᵀ·dY) → ``class_efficiency``
  ``gemm_dgrad`` and ``gemm_wgrad`` (the forward ones give ``gemm_fwd``);
- a spread of them in FP8 (``torch._scaled_mm``) where the device runs it →
  ``peak_tflops.fp8`` and ``fp8_gemm_efficiency`` (:mod:`calibration.microbench.bench_fp8`);
- ``scaled_dot_product_attention`` forward and backward → ``attention_efficiency``,
  ``attention_fwd`` and ``attention_bwd``;
- layer/RMS norm, softmax, GELU, SwiGLU, add, mul, a sum, a copy and an AdamW
  step → HBM bandwidth, ``memory_efficiency`` and a curve per memory-bound cost
  class; tiny adds and copies → ``kernel_overhead_us`` (the intercept);
- a GEMM alone and under all-reduces, in the collectives' launch → ``interference``;
- all-reduces after a compute burst against back to back, in the same launch →
  ``collective_sync_us`` (:mod:`calibration.microbench.terms.collective_sync`);
- a ping-pong of sends after a compute burst against back to back, in the same launch →
  ``send_sync_us`` (:mod:`calibration.microbench.terms.send_sync`);
- the same compute burst on two ranks at once, in the same launch → ``rank_spread``
  (:mod:`calibration.microbench.terms.rank_spread`);
- the issuing thread's time in DTensor's redistributions (all-reduce, all-gather,
  reduce-scatter) against the plain c10d collectives, in the same launch →
  ``funcol_host`` (:mod:`calibration.microbench.terms.funcol_host`);
- all-reduce, all-gather, reduce-scatter, broadcast, send/recv and all-to-all under torchrun
  (gloo on CPU, NCCL on CUDA), 1 KiB up to 64 MiB (1 GiB on GPUs without
  ``--quick``), every group size 2..N → α and busbw per collective, or the same
  fitted from nccl-tests output (``--from-nccl-tests``).

Cost semantics and fitting rules: :mod:`calibration.microbench.fit`. Timing rules:
:mod:`calibration.microbench.bench_timing`. Every measurement goes to a JSONL results file
the moment it is taken, so an interrupted run resumes where it stopped
(:mod:`calibration.microbench.bench_results`): Ctrl-C or SIGTERM exits 130 / 143 saying
how many measurements the file keeps, and the rerun says how many it reuses. On a CPU
a "GPU" is one process with ``--threads`` threads (one by default), the same device the
measured CPU runs use. The phases (:mod:`calibration.microbench.phases`) run between
timings of a reference GEMM (at the start and after each phase), and on a VM the
hypervisor's steal share is counted: they guard against a busy machine
(:mod:`calibration.microbench.busy_guard`; ``--retry-busy N`` re-measures), and
every fitted term's spread goes to the profile's ``uncertainty``
(:mod:`calibration.microbench.spread`). The flags are resolved in
:mod:`calibration.microbench.calibrate_options`; the records are fitted in
:mod:`calibration.microbench.fit_profile` and the profile written by
:mod:`calibration.microbench.profile_build`.

torch is imported only when a calibration runs: ``import calibration.microbench.calibrate``
works without it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from calibration.microbench.calibrate_options import Options, resolve_options
from calibration.microbench.phases import compute_phases, datasheet, phases
from simulator.errors import Interrupted, Problem, UserError

DESCRIPTION = """\
Measure this machine and write a hardware profile (the presets' schema; a scenario
uses it with cluster.system: PROFILE.yaml): GEMMs shaped like the bundled models'
layers (forward and both backward layouts), scaled_dot_product_attention forward
and backward, memory-bound kernels (norms, softmax, GELU, SwiGLU, add, mul, sum,
copy, AdamW) with a curve per cost class, the per-kernel overhead (tiny kernels'
intercept), all-reduce/all-gather/reduce-scatter/broadcast/send-recv/all-to-all
under torchrun (gloo on cpu, NCCL on cuda), a GEMM's slowdown under them and
what an all-reduce after compute costs beyond back to back.
A reference GEMM timed at the start and after each phase (a WARNING names the
phase it drifted >15% in) and the hypervisor's steal share warn of a busy machine;
each fitted term's spread goes to the profile's uncertainty section (used by
'clustersim run --uncertainty N'). Every measurement is appended to a
results file at once: after Ctrl-C or SIGTERM (exit 130 / 143), rerun the same
command to resume; it reuses what the file holds and measures only the rest.
'calibrate report PROFILE.yaml --out DIR' plots measured vs fitted."""

EPILOG = """\
examples:
  clustersim calibrate --device cpu --quick --out cpu.yaml
      a few minutes: 1-thread CPU "GPUs", 2 gloo processes, GEMM/attention/memory/collectives
  clustersim calibrate --device cpu --quick --retry-busy 2 --out cpu.yaml
      re-measure the compute part up to twice while the machine looks busy
  clustersim calibrate --device cuda --dtype bf16 --out calibration/profiles/h100.yaml
      all GPUs of this node; resumable: rerun the same command after an interruption
  clustersim host-cost calibration/profiles/h100.yaml --device cuda
      then eager PyTorch's host time per kernel, which the kernel timings leave out
  clustersim calibrate --device cuda --from-nccl-tests all_reduce.json all_gather.txt --out p.yaml
      GEMMs measured here, collectives fitted from nccl-tests output (-J JSON or text)
  clustersim calibrate report cpu.yaml --out cpu-report/
      plots of measured vs fitted, and a markdown table of fit errors
"""

REPORT_EPILOG = """\
example:
  clustersim calibrate report cpu.yaml --out cpu-report/
      writes gemm.png, attention.png, memory.png, collectives.png and fit_errors.md
"""

PARTS = ("gemm", "attention", "memory", "collectives")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``calibrate`` (and ``calibrate report``) on the CLI's subparsers."""
    p = subparsers.add_parser(
        "calibrate", help="measure this machine (GEMM, attention, memory, collectives) "
        "and write a hardware profile", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="what to calibrate (default: cuda when PyTorch sees a GPU, else cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="GEMM/attention dtype fitted in full (default bf16 on cuda, fp32 on cpu)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="fewer, smaller shapes; messages up to 64 MiB (minutes)")
    size.add_argument("--tiny", action="store_true",
                      help="smoke-test size (well under a minute on a CPU): tests, notebooks")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="processes for collectives (default: all GPUs; on cpu min(2, cores))")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="CPU threads per process, i.e. per CPU 'GPU' (default 1)")
    p.add_argument("--results", metavar="FILE.jsonl",
                   help="measurement log; reused to resume (default: PROFILE.results.jsonl)")
    p.add_argument("--out", metavar="PROFILE.yaml", help="profile to write (required)")
    p.add_argument("--from-nccl-tests", nargs="+", metavar="[OP:][LINK:]FILE",
                   help="fit collectives from nccl-tests output (-J JSON or text) instead of "
                   "measuring them; OP/LINK prefixes name what the file cannot")
    p.add_argument("--skip", action="append", choices=PARTS, default=[],
                   help="leave a part unmeasured (taken from --base); repeatable")
    p.add_argument("--base", metavar="PRESET",
                   help="preset or profile for what is not measured (default: the matching "
                   "datasheet preset on cuda, cpu-1thread on cpu)")
    p.add_argument("--scenario", metavar="SCENARIO.yaml",
                   help="also time every GEMM this scenario's model runs at its TP degree and "
                        "micro-batch (the shapes its simulation prices), beside the bundled "
                        "models' sweep")
    p.add_argument("--name", help="profile name (default: calibrated-<device>)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds before the collectives' torchrun launch is killed "
                   "(default 300 on cpu, 1800 on cuda)")
    p.add_argument("--retry-failed", action="store_true",
                   help="re-measure what the results file records as failed")
    p.add_argument("--retry-busy", type=int, default=0, metavar="N",
                   help="when the reference GEMM drifts >15%% from its first reading, repeats "
                   "scatter >12%% or a hypervisor takes >5%% of the CPU (steal), re-measure "
                   "the compute part up to N times (default 0: "
                   "only warn)")
    p.set_defaults(func=run_calibrate)
    sub = p.add_subparsers(dest="calibrate_action", metavar="{report}")
    r = sub.add_parser("report", help="plot a calibrated profile's measured vs fitted numbers",
                       description="Plot measured vs fitted (GEMM efficiency vs FLOPs, busbw vs "
                       "message size) and write a markdown table of fit errors.",
                       epilog=REPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("profile", metavar="PROFILE.yaml")
    r.add_argument("--out", required=True, metavar="DIR", help="directory for the plots and table")
    r.add_argument("--results", metavar="FILE.jsonl",
                   help="measurements to plot (default: the one the profile's provenance names)")
    r.set_defaults(func=run_report_cli)


def run_report_cli(args: argparse.Namespace) -> int:
    from calibration.microbench.report import write_report

    written = write_report(Path(args.profile), Path(args.out),
                           Path(args.results) if args.results else None)
    for path in written:
        print(path)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    opts = resolve_options(args)
    from simulator.system.profiles import load_system

    try:
        base = load_system(opts.base)  # a bad --base fails before any measuring
    except UserError as exc:
        raise UserError([Problem("--base", opts.base, str(p).split(": ", 1)[-1])
                         for p in exc.problems]) from None
    nccl_runs = _load_nccl_tests(opts.nccl_specs)
    profile_path = calibrate(opts, base, nccl_runs)
    print(profile_path)
    return 0


def _load_nccl_tests(specs: tuple[str, ...]) -> list[Any]:
    from calibration.microbench import nccl_tests

    return [nccl_tests.load(spec) for spec in specs]


def calibrate(opts: Options, base: Any, nccl_runs: list[Any]) -> Path:
    """Measure (or resume), fit, and write the profile; returns its path. Ctrl-C or
    SIGTERM stops it with :class:`~simulator.errors.Interrupted` saying how many
    measurements the results file keeps and how to resume."""
    import torch

    from calibration.microbench.bench_results import ResultsStore
    from calibration.microbench.bench_shapes import scenario_gemm_shapes
    from calibration.microbench.bench_timing import Device, budget_for, device_info

    store = ResultsStore(opts.results, retry_failed=opts.retry_failed)
    device = Device(opts.device, opts.threads)
    budget = budget_for(opts.device, opts.level)
    if opts.scenario:  # its model's GEMMs, as its stack builds them, timed first
        budget = replace(budget, scenario_gemms=scenario_gemm_shapes(opts.scenario, budget))
    threads_before = torch.get_num_threads()
    started = time.perf_counter()
    reused = len(store.measured())
    _say(f"calibrating {opts.device_name} ({opts.device}, {opts.threads} thread(s) per process, "
         f"{opts.dtype}, {opts.level}); measurements -> {opts.results}")
    if reused:
        _say(f"resuming: {reused} measurements already in {opts.results} are reused, not "
             "measured again; measuring only the rest")
    try:
        device.setup()
        info = device_info(device, opts.nproc)
        guard = _guarded(opts, device, budget, store, bool(nccl_runs))
    except KeyboardInterrupt as exc:  # SIGTERM arrives as Interrupted (simulator.cli.main)
        kept = len(store.measured())
        raise Interrupted(getattr(exc, "signal_name", "SIGINT"),
                          f"{kept} measurements kept in {opts.results} ({kept - reused} taken "
                          f"by this run), no profile written; run the same command again to "
                          "measure only the rest") from None
    finally:
        torch.set_num_threads(threads_before)
    elapsed = time.perf_counter() - started
    _say(f"measured {len(store.measured()) - reused} this run, reused {reused} from "
         f"{opts.results}")
    return _fit_and_write(opts, base, store, info, nccl_runs, elapsed, guard)


def _guarded(opts: Options, device: Any, budget: Any, store: Any,
             have_nccl: bool) -> dict[str, Any]:
    """Measure each phase between timings of the reference GEMM; while the machine looks
    busy and ``--retry-busy`` allows, measure the compute part again. Returns the verdict
    (with the attempts taken and the warning, if any) for the provenance."""
    import dataclasses

    from calibration.host import StealMeter
    from calibration.microbench.bench_terms import time_reference
    from calibration.microbench.busy_guard import judge, read_between

    def reference(phase: str) -> dict[str, Any]:
        return time_reference(device, opts.dtype, budget, phase)

    def count() -> int:
        return len(store.records())

    first = count()
    with StealMeter() as steal:
        readings = read_between(phases(opts, device, budget, store, have_nccl), reference,
                                count, _say)
    verdict = judge(readings, store.records()[first:], steal.share)
    attempt = 0
    while verdict.busy and attempt < opts.retry_busy:
        attempt += 1
        _say(f"{verdict.warning(None)} Re-measuring the compute part "
             f"(--retry-busy: attempt {attempt} of {opts.retry_busy}).")
        first = count()
        again = dataclasses.replace(budget, retry=attempt)
        with StealMeter() as steal:
            readings = read_between(compute_phases(opts, device, again, store), reference,
                                    count, _say, f" (re-measure {attempt})")
        verdict = judge(readings, store.records()[first:], steal.share)
    warning = verdict.warning(attempt)
    if warning:
        _say(warning)
    return {**verdict.as_dict(), "retries": attempt, "warning": warning}


def _fit_and_write(opts: Options, base: Any, store: Any, info: dict[str, Any],
                   nccl_runs: list[Any], elapsed: float, guard: dict[str, Any]) -> Path:
    from calibration.microbench.fit_profile import (
        fit_collectives,
        fit_compute,
        samples_from_records,
    )
    from calibration.microbench.profile_build import build_profile, write_profile
    from calibration.microbench.report_tables import collective_table, summary_text
    from calibration.microbench.terms.registry import in_profile_order

    records = store.records()
    fits = fit_compute(records, opts.device, opts.dtype, opts.threads, opts.device_name,
                       guard.get("drift"))
    if nccl_runs:
        samples: dict[str, dict[str, list[Any]]] = {}
        for run in nccl_runs:
            samples.setdefault(run.op, {}).setdefault(run.link, []).extend(run.samples())
    else:
        samples = samples_from_records(records, opts.device, opts.threads)
    fit_collectives(fits, samples)
    if samples:
        print(collective_table(samples, fits.collectives))
    failed = [r for r in store.latest().values() if not r.get("ok")]
    prov = {
        "tool": "clustersim calibrate",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **info,
        "dtype": opts.dtype,
        "level": opts.level,
        "results_file": _relative(opts.results, opts.out.parent),
        "run_wall_time_s": round(elapsed, 1),  # this invocation (a resumed run: the rest)
        "measured_from": min((r["timestamp"] for r in records if "timestamp" in r), default=None),
        "measured_to": max((r["timestamp"] for r in records if "timestamp" in r), default=None),
        "samples": {k: len({r["key"] for r in records if r.get("kind") == k and r.get("ok")})
                    for k in ("gemm", "gemm_layout", "gemm_fp8", "attention", "attention_bwd",
                              "memory", "overhead", "collective", *in_profile_order())},
        "busy_guard": guard,
        "failed": [{"key": r["key"], "error": r.get("error", "")} for r in failed[:20]],
        "failed_count": len(failed),
        "nccl_tests_files": [{"op": r.op, "link": r.link, "nranks": r.nranks,
                              "spec": f"{r.op}:{r.link}:{Path(r.source).resolve()}"}
                             for r in nccl_runs],
    }
    mem_GB = _memory_GB(opts)
    intra = [r.nranks for r in nccl_runs if r.link == "intra_node"]
    per_node = (max(intra) if intra else opts.nproc if opts.device == "cpu"
                else info.get("device_count", opts.nproc))
    profile = build_profile(fits, base, name=opts.name, device=opts.device,
                            device_name=opts.device_name, gpus_per_node=per_node,
                            memory_GB=mem_GB, provenance=prov,
                            datasheet=opts.device == "cuda" and datasheet(opts))
    write_profile(profile, opts.out)
    _say(summary_text(profile, failed, elapsed))
    return opts.out


def _memory_GB(opts: Options) -> float | None:
    if opts.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 1e9
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return total / 1e9 / max(opts.nproc, 1)


def _relative(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except ValueError:  # another drive (Windows)
        return str(path.resolve())


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)

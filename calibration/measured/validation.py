"""The validation table: real runs of fixed small configurations against their simulation.

``clustersim validation --device cpu --out DIR`` calibrates this machine once (or
takes ``--profile``; on CPU it then adds the eager host cost per kernel and DTensor's
per op, calibration/measured/host_cost.py, and torch.distributed.pipelining's per
action, calibration/measured/pipeline_cost.py), then for each configuration runs
``measure`` (torchrun, the small GPT with real TP / PP / DP; on CPU its timed steps
span at least ``--min-seconds``, :data:`MIN_SECONDS`) and ``compare`` (the same
scenario simulated with that profile), and writes ``DIR/validation.md`` and
``DIR/validation.csv``: one row per configuration with measured and simulated step
time and the error, one table per model (``--model small-gpt,tiny-gpt`` runs both from
the one calibration), each ending with its mean and largest |step error|. On CPU each
configuration runs twice back to back (``--repeats``, :data:`REPEATS`) and the median
of their pooled steps is compared; the ``repeat`` column says how far the two runs'
medians lay apart, the measurement's own repeatability, and each table's summary what
that alone costs a simulator without error (:func:`repeatability_sentence`). A run
during which a hypervisor took more than :data:`calibration.host.STEAL_LIMIT` of the
CPU (steal) is set aside and measured again (``--retries``); pooled steps that scatter
more than :data:`SPREAD_LIMIT` are named in the row's note; each row keeps its runs'
largest steal share, the header the calibration's. After the last row the
calibration's two-rank terms are measured again (:mod:`calibration.measured.recheck`;
``--no-recheck`` skips it) and the tables end with them beside the profile's figures:
how far the machine moved while the rows ran.

The configurations on CPU, world size 2, one thread per process: DP 2 (DDP),
PP 2 with GPipe and with 1F1B, TP 2, TP 2 with sequence parallelism (DTensor
``SequenceParallel`` on the norms, simulated with ``parallel.sequence_parallel``),
FSDP 2 (ZeRO-3), the MoE GPT (4 experts, top-2) with EP 2, CP 2 (the sequence split,
K and V all-gathered), and DP 2 and PP 2 (1F1B) with rank 1 a straggler on purpose
(its compute twice as long, ``measure --slow-rank 1 --slowdown 2``, simulated with
``variability.slow_gpus`` at the slowdown it actually ran with, which the row's note
gives: what it slept and the cold caches it woke to,
:func:`calibration.measured.compare.slowdown_as_slept`). With more devices
(``--device cuda`` and ≥ 4 GPUs) TP 2 · PP 2 and DP 2 · PP 2 join them.
Each measurement and comparison stays in ``DIR/runs/<name>/`` (``DIR/runs/<model>/<name>/``
with two models; a configuration's second run in ``<name>-run2/``) for inspection;
a configuration that fails is recorded in the table with its error, not fatal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from calibration.host import STEAL_LIMIT, StealMeter
from calibration.measured.validation_configs import (
    MIN_SECONDS,
    MODEL_STEPS,
    Config,
    configs_for,
    models,
    select,
)
from calibration.measured.validation_runs import REPEATS, min_seconds, repeats, run_one
from calibration.measured.validation_table import markdown, write_table
from simulator.errors import Problem, UserError


def check_profile(profile: str | None) -> None:
    """A ``--profile`` that is no loadable profile fails before any run, not at compare."""
    if profile:
        from simulator.system.profiles import load_system

        try:
            load_system(profile)
        except UserError as exc:
            first = exc.problems[0]
            why = first.fix if isinstance(first, Problem) else str(first)
            raise UserError([Problem("--profile", profile, why + "; pass "
                                     "a 'clustersim calibrate' profile or drop --profile "
                                     "to calibrate first")]) from None


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _profile(args: argparse.Namespace, out: Path) -> str:
    if args.profile:
        return str(args.profile)
    from calibration.microbench.calibrate import add_parser, run_calibrate

    path = out / f"profile-{args.device}.yaml"
    # a busy guard that fires (drift, scatter, steal) re-measures the compute part once
    argv = ["calibrate", "--device", args.device, "--out", str(path),
            "--threads", str(args.threads), "--retry-busy", "1"]
    argv += ["--quick"] if not args.tiny else ["--tiny"]
    _say(f"[validation] calibrating {args.device} once -> {path}")
    parser = argparse.ArgumentParser(prog="clustersim")
    add_parser(parser.add_subparsers())  # the calibrate command's own flags and defaults
    try:
        run_calibrate(parser.parse_args(argv))
    except UserError as exc:
        raise UserError([*exc.problems, Problem("calibrate", args.device, "calibration "
                                                "failed; or pass --profile PROFILE.yaml")]
                        ) from None
    if args.device == "cpu":  # the eager host cost, serial with the kernels on a CPU
        from calibration.measured.host_cost import add_to_profile

        host = add_to_profile(str(path), args.threads)
        t = host["step_s_min"]
        ms = " and ".join(f"{m} micro-batches {t[m] * 1e3:.2f} ms" for m in t)
        _say(f"[validation] eager host cost {host['host_overhead_us']:.1f} us per kernel, "
             f"{host['host_optimizer_us']:.1f} us per optimizer kernel (steps of {ms}); "
             f"DTensor {host['dtensor_gemm_us']} us per GEMM, {host['dtensor_overhead_us']} "
             f"us per other op it dispatches -> {path}")
        from calibration.measured import pipeline_cost

        pipe = pipeline_cost.add_to_profile(str(path), args.threads)
        _say(f"[validation] pipelining runtime {pipe['pipeline_action_us']:.0f} us per "
             f"action (two-stage GPipe at a degenerate size, {pipe['micro_batches']} "
             f"micro-batches) -> {path}")
    return str(path)


def profile_steal(path: str) -> float | None:
    """The steal share the profile's calibration recorded (its busy guard), if any."""
    import yaml

    try:
        prov = (yaml.safe_load(Path(path).read_text()) or {}).get("provenance") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    steal = (prov.get("busy_guard") or {}).get("steal")
    return float(steal) if isinstance(steal, (int, float)) else None


def _recheck(args: argparse.Namespace, out: Path, profile: str) -> str:
    """The sentence on the two-rank terms measured again after the last row (empty with
    ``--no-recheck``, or when none could be measured)."""
    import yaml

    from calibration.measured import recheck

    if args.no_recheck:
        return ""
    _say("[validation] measuring the calibration's two-rank terms again (the machine now)")
    now = recheck.remeasure(args.device, args.threads, out, args.timeout)
    text = recheck.sentence(now, recheck.calibrated(yaml.safe_load(Path(profile).read_text())))
    if not text:
        _say("[validation] the two-rank terms could not be measured again: "
             f"see {out / 'recheck.results.jsonl'}")
    return text


def set_aside(out: Path, names: list[str]) -> list[Path]:
    """Rename each of ``names`` under ``out`` that exists to ``NAME.<its mtime>.old`` and
    say so; returns the new paths. A validation compares against the machine as it is
    now: the calibration and the recheck resume from their results files, so one left
    in ``out`` by an earlier run would hand its old measurements (another hour's
    machine, another version's code) to this one, under today's date."""
    moved = []
    for name in names:
        path = out / name
        if path.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
            new = path.with_name(f"{name}.{stamp}.old")
            path.replace(new)
            moved.append(new)
            _say(f"[validation] {path} is an earlier run's: set aside as {new.name}, "
                 "measuring afresh")
    return moved


def run_validation(args: argparse.Namespace) -> int:
    from calibration.host import cpu_name, require_torch

    torch = require_torch()

    out = Path(args.out)
    devices = torch.cuda.device_count() if args.device == "cuda" else 2
    _check_flags(args, devices)
    names = models(args.model)
    configs = select(configs_for(args.device, devices), args.only)
    check_profile(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    set_aside(out, ([] if args.profile else [f"profile-{args.device}.results.jsonl"])
              + ([] if args.no_recheck else ["recheck.results.jsonl"]))
    with StealMeter() as calibrating:  # the calibration and the host-cost runs after it
        profile = _profile(args, out)
    calibration_steal = profile_steal(profile) if args.profile else calibrating.share
    rows = _rows(args, out, profile, names, configs)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_name()
    header = {"device": args.device, "device_name": name, "threads": args.threads,
              "torch": torch.__version__, "profile": profile, "date": time.strftime("%Y-%m-%d"),
              "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size,
              "model": names[0], "calibration_steal": calibration_steal,
              "steps": {m: args.steps or MODEL_STEPS[m][0] for m in names},
              "min_seconds": min_seconds(args), "repeats": repeats(args),
              "recheck": _recheck(args, out, profile)}
    paths = write_table(out, rows, header)
    print(markdown(rows, header))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _check_flags(args: argparse.Namespace, devices: int) -> None:
    """The device count and the run flags checked before anything is measured."""
    if args.device == "cuda" and devices < 2:
        raise UserError([Problem("--device", "cuda", f"{devices} GPU(s) visible; the table "
                                 "needs at least 2 (use --device cpu)")])
    if not 0 <= args.retries <= 5:
        raise UserError([Problem("--retries", args.retries, "use 0 to 5 re-measures")])
    if not 1 <= repeats(args) <= 5:
        raise UserError([Problem("--repeats", repeats(args), "use 1 to 5 runs per "
                                 "configuration")])
    if not 0 <= min_seconds(args) < args.timeout:
        raise UserError([Problem("--min-seconds", min_seconds(args),
                                 f"use 0 or more seconds, below --timeout ({args.timeout:g})")])


def _rows(args: argparse.Namespace, out: Path, profile: str, names: tuple[str, ...],
          configs: tuple[Config, ...]) -> list[dict[str, Any]]:
    """Every model's every configuration measured and compared, a row each, in order."""
    rows = []
    total, i = len(configs) * len(names), 0
    for model in names:
        for cfg in configs:
            i += 1
            label = f"[validation {i}/{total}] {cfg.name}" + \
                (f" ({model})" if len(names) > 1 else "")
            _say(f"{label}: measure + compare ...")
            t0 = time.perf_counter()
            run_dir = out / "runs" / (f"{model}/{cfg.name}" if len(names) > 1 else cfg.name)
            rows.append(run_one(cfg, args, profile, run_dir, model))
            err = rows[-1].get("step_error")
            _say(f"{label}: "
                 f"{'step error ' + format(err, '+.1%') if err is not None else rows[-1]['note']}"
                 f" ({time.perf_counter() - t0:.0f} s)")
    return rows


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "validation", help="measure fixed small configurations and compare each with "
        "its simulation (docs/validation.md's table)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="example:\n  clustersim validation --device cpu --out runs/validation\n"
        "  clustersim validation --device cpu --model small-gpt,tiny-gpt --out runs/val\n"
        "  clustersim validation --device cpu --profile cpu.yaml --out runs/validation",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", required=True, help="directory for the profile, runs and table")
    p.add_argument("--profile", help="use this hardware profile instead of calibrating")
    p.add_argument("--threads", type=int, default=1, help="threads per process on CPU")
    p.add_argument("--steps", type=int, help="timed steps per run (median; default 8 for "
                   "small-gpt, 30 for tiny-gpt)")
    p.add_argument("--min-seconds", type=float, metavar="S",
                   help="time more steps than --steps where those span less than S seconds "
                   f"(default {MIN_SECONDS['cpu']:g} on cpu: a 2-core VM's pace moves on a "
                   "scale of seconds; 0 on cuda)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2 for small-gpt, "
                   "5 for tiny-gpt)")
    p.add_argument("--model", default="small-gpt", metavar="MODEL[,MODEL]",
                   help="measured GPT(s), comma-separated: small-gpt (the default: kernels "
                   "dominate) and tiny-gpt (overheads dominate); 'small-gpt,tiny-gpt' runs "
                   "both from the one calibration, one table each")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="runs of each configuration back to back, their timed steps pooled "
                   f"(the median of all is compared; default {REPEATS['cpu']} on cpu, where "
                   f"the table's 'repeat' column says how far their medians lay apart, "
                   f"{REPEATS['cuda']} on cuda)")
    p.add_argument("--retries", type=int, default=1, metavar="N",
                   help="runs in addition, up to N, for runs during which a hypervisor took "
                   f"more than {STEAL_LIMIT:.0%}% of the CPU (steal; such a run is set aside, "
                   "not pooled; default 1)")
    p.add_argument("--only", metavar="NAME[,NAME]",
                   help="run only these configurations (e.g. cp2-allgather)")
    p.add_argument("--tiny", action="store_true", help="smoke-test calibration size (tests)")
    p.add_argument("--no-recheck", action="store_true",
                   help="skip measuring the calibration's two-rank terms (rank spread, "
                   "sync costs, interference) again after the last row")
    p.set_defaults(func=run_validation)

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
import csv
import io
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.host import STEAL_LIMIT, StealMeter
from simulator.errors import Problem, UserError


@dataclass(frozen=True)
class Config:
    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    zero: int = 0
    powersgd_rank: int = 0  # PyTorch's PowerSGD DDP hook (calibration/measured/compression_hook)
    experts: int = 0  # > 0: the MoE GPT with EP (calibration/measured/moe_worker)
    ep: int = 1
    cp: int = 1  # > 1: the sequence split, K and V all-gathered (calibration/measured/cp_worker)
    slow_rank: int = -1  # a straggler on purpose (calibration/measured/slow_rank.py) ...
    slowdown: float = 1.0  # ... whose compute takes this many times as long
    sequence_parallel: bool = False  # TP with DTensor SequenceParallel (parallel_worker.tp_plan)


CPU_CONFIGS = (
    Config("dp2-ddp", dp=2),
    Config("dp2-powersgd", dp=2, powersgd_rank=4),
    Config("pp2-gpipe", pp=2, schedule="gpipe"),
    Config("pp2-1f1b", pp=2, schedule="1f1b"),
    Config("tp2", tp=2),
    Config("tp2-sp", tp=2, sequence_parallel=True),
    Config("fsdp2", dp=2, zero=3),
    Config("ep2-moe", dp=2, experts=4, ep=2),
    Config("cp2-allgather", cp=2),
    Config("dp2-slow1x2", dp=2, slow_rank=1, slowdown=2.0),
    Config("pp2-1f1b-slow1x2", pp=2, schedule="1f1b", slow_rank=1, slowdown=2.0),
)
MULTI_GPU_CONFIGS = (
    Config("tp2-pp2", tp=2, pp=2),
    Config("dp2-pp2", dp=2, pp=2),
)
#: timed and warm-up steps per run by model, where --steps/--warmup leave them: a
#: tiny-gpt step is ~50-300 ms, so more of them cost little and steady the median
MODEL_STEPS = {"small-gpt": (8, 2), "tiny-gpt": (30, 5)}
#: ... and on CPU at least this many seconds of them (``measure --min-seconds``): on the
#: project's 2-core VM a run's level moves on a scale of seconds (tiny-gpt TP 2, six
#: 30-step runs back to back, 13 s each: medians 373-496 ms, none of it in a reference
#: GEMM loop timed between them), so a 2-3 s tiny-gpt run was one draw of that level
MIN_SECONDS = {"cpu": 20.0, "cuda": 0.0}
MODELS = tuple(MODEL_STEPS)
COLUMNS = ("model", "config", "tp", "pp", "dp", "schedule", "zero", "measured_ms", "simulated_ms",
           "step_error", "runs", "repeat", "compute_error", "idle_measured", "idle_simulated",
           "cpu_steal", "note")


def configs_for(device: str, devices: int) -> tuple[Config, ...]:
    extra = MULTI_GPU_CONFIGS if device == "cuda" and devices >= 4 else ()
    return CPU_CONFIGS + extra


def select(configs: tuple[Config, ...], only: str | None) -> tuple[Config, ...]:
    """The configurations named in ``only`` (comma-separated), in table order; all without."""
    if not only:
        return configs
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [c.name for c in configs]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError([Problem("--only", only, f"unknown configuration(s) {unknown}; "
                                 f"choose from {', '.join(known)}")])
    return tuple(c for c in configs if c.name in names)


def models(spec: str) -> tuple[str, ...]:
    """The models named by ``--model`` (comma-separated), or a UserError naming them."""
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise UserError([Problem("--model", spec, f"unknown model(s) {unknown}; use one "
                                 f"or more of {', '.join(MODELS)}, comma-separated")])
    return names


def check_profile(profile: str | None) -> None:
    """A ``--profile`` that is no loadable profile fails before any run, not at compare."""
    if profile:
        from simulator.system.hardware import load_system

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


def _row(cfg: Config, comparison: dict[str, Any] | None, note: str = "",
         model: str = "", steal: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model, "config": cfg.name, "tp": cfg.tp, "pp": cfg.pp,
                           "dp": cfg.dp, "schedule": cfg.schedule, "zero": cfg.zero,
                           "cpu_steal": steal, "note": note}
    if comparison is not None:
        meas, sim, err = (comparison["measured"], comparison["simulated"],
                          comparison["relative_error"])
        row.update(measured_ms=meas["step_time_s"] * 1e3, simulated_ms=sim["step_time_s"] * 1e3,
                   step_error=err["step_time_s"], compute_error=err["compute_s"],
                   idle_measured=meas["idle_fraction"], idle_simulated=sim["idle_fraction"])
    return row


#: a row whose pooled steps scatter more than this (interquartile range over the median)
#: ran on a busy machine (on this project's VM a slow spell turns some steps 40% longer):
#: the row's note says so
SPREAD_LIMIT = 0.10
#: runs of each configuration, back to back, whose timed steps are pooled, where
#: ``--repeats`` leaves it: on the project's 2-vCPU VM two 20 s runs of one tiny-gpt
#: configuration differed by 8% on average (small-gpt 6%; 2026-12-05, 54 and 13 pairs,
#: the second run of each measured because the first one's steps scattered),
#: so one run was one draw of a pace that wanders on a scale of seconds. Two runs halve
#: that draw's variance, and their difference is the measurement's repeatability that the
#: table shows beside the error (:func:`repeatability_sentence`)
REPEATS = {"cpu": 2, "cuda": 1}


def step_spread(times: list[float]) -> float:
    """The interquartile range of a run's step times over their median: the calibration's
    repeat spread (:func:`calibration.microbench.bench_timing.repeat_spread`) applied to
    steps, with inclusive quartiles (a run has few steps)."""
    from calibration.microbench.bench_timing import repeat_spread

    return repeat_spread(times, "inclusive")


@dataclass(frozen=True)
class Run:
    """One measured run of a configuration: its directory, timed steps and steal share."""
    out: Path
    steps: tuple[float, ...]
    steal: float | None

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def stolen(self) -> bool:
        return (self.steal or 0.0) > STEAL_LIMIT


@dataclass(frozen=True)
class Pooled:
    """A configuration's runs as the row uses them: the runs pooled (every run the
    hypervisor did not take over :data:`STEAL_LIMIT` of the CPU from, or the least
    stolen one when it took it from all) and the runs set aside for steal."""
    runs: tuple[Run, ...]
    set_aside: tuple[Run, ...]

    @property
    def step_s(self) -> float:
        """The median of every pooled run's timed steps."""
        return statistics.median([t for r in self.runs for t in r.steps])

    @property
    def spread(self) -> float:
        return step_spread([t for r in self.runs for t in r.steps])

    @property
    def repeat(self) -> float | None:
        """How far the pooled runs' medians lie apart, over the pooled median (None with
        one run): the measurement's own repeatability."""
        if len(self.runs) < 2:
            return None
        medians = [r.median for r in self.runs]
        return (max(medians) - min(medians)) / self.step_s

    @property
    def steal(self) -> float | None:
        shares = [r.steal for r in self.runs if r.steal is not None]
        return max(shares) if shares else None


def pool(runs: list[Run]) -> Pooled:
    """The runs a row pools (:class:`Pooled`)."""
    calm = tuple(r for r in runs if not r.stolen)
    if calm:
        return Pooled(calm, tuple(r for r in runs if r.stolen))
    least = min(runs, key=lambda r: r.steal or 0.0)
    return Pooled((least,), tuple(r for r in runs if r is not least))


def pool_note(pooled: Pooled) -> str:
    """What the table says of a row's runs: steps scattered over :data:`SPREAD_LIMIT`,
    runs set aside for steal, or every run stolen."""
    notes = []
    if pooled.spread > SPREAD_LIMIT:
        notes.append(f"steps scattered {pooled.spread:.0%} (a busy machine)")
    if pooled.set_aside:
        shares = ", ".join(_pct(r.steal) for r in pooled.set_aside)
        notes.append(f"{len(pooled.set_aside)} run(s) set aside for steal ({shares})"
                     + ("; every run stolen, kept the least" if pooled.runs[0].stolen
                        else ""))
    return "; ".join(notes)


def steal_note(steal: float | None) -> str:
    """What the table says of a row measured while a hypervisor took the CPU."""
    if steal is None or steal <= STEAL_LIMIT:
        return ""
    return f"the hypervisor took {steal:.0%} of the CPU (steal) during the run"


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def repeats(args: argparse.Namespace) -> int:
    """Runs per configuration: ``--repeats``, else :data:`REPEATS` of the device."""
    given = getattr(args, "repeats", None)
    return REPEATS[args.device] if given is None else int(given)


def run_one(cfg: Config, args: argparse.Namespace, profile: str, run_dir: Path,
            model: str) -> dict[str, Any]:
    """Measure ``--repeats`` runs back to back (one more, up to ``--retries`` times, for
    each the hypervisor took over :data:`STEAL_LIMIT` of the CPU from) and compare the
    median of their pooled steps (:func:`pool`)."""
    from calibration.measured.compare import run_compare
    from calibration.measured.measure import run_measure

    steps, warmup = MODEL_STEPS[model]
    want = repeats(args)
    runs: list[Run] = []
    try:
        while sum(not r.stolen for r in runs) < want and len(runs) < want + args.retries:
            n = len(runs)
            out = run_dir if n == 0 else run_dir.with_name(f"{run_dir.name}-run{n + 1}")
            got = run_measure(
                cfg.tp, cfg.pp, cfg.dp, schedule=cfg.schedule, zero=cfg.zero,
                micro_batches=args.micro_batches, model=model, steps=args.steps or steps,
                warmup=args.warmup if args.warmup is not None else warmup,
                device=args.device, out_dir=str(out), threads=args.threads,
                timeout_s=args.timeout, micro_batch_size=args.micro_batch_size,
                powersgd_rank=cfg.powersgd_rank, experts=cfg.experts, ep=cfg.ep, cp=cfg.cp,
                slow_rank=cfg.slow_rank, slowdown=cfg.slowdown,
                sequence_parallel=cfg.sequence_parallel, min_seconds=min_seconds(args))
            runs.append(Run(out, tuple(got["step_times_s"]), got.get("cpu_steal")))
            if runs[-1].stolen:
                _say(f"[validation] {cfg.name}: the hypervisor took {_pct(runs[-1].steal)} "
                     f"of the CPU (limit {STEAL_LIMIT:.0%})"
                     + (", measuring again" if len(runs) < want + args.retries else ""))
        pooled = pool(runs)
        comparison = run_compare(pooled.runs[0].out, profile, step_time_s=pooled.step_s)
    except Exception as exc:
        return _row(cfg, None, f"failed: {str(exc).splitlines()[0][:160]}", model)
    slept = comparison.get("slowdown_as_slept")
    slept_note = "" if slept is None else \
        f"straggler as it ran: x{slept['compute_slowdown']:.2f} (asked x{cfg.slowdown:g})"
    row = _row(cfg, comparison, _join(pool_note(pooled), steal_note(pooled.steal), slept_note),
               model, pooled.steal)
    row.update(runs=len(pooled.runs), repeat=pooled.repeat)
    return row


def min_seconds(args: argparse.Namespace) -> float:
    """Seconds a run's timed steps span at least: ``--min-seconds``, else
    :data:`MIN_SECONDS` of the device."""
    given = getattr(args, "min_seconds", None)
    return MIN_SECONDS[args.device] if given is None else float(given)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _fmt(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    if v is None:
        return "–"
    if key.endswith("_ms"):
        return f"{v:.1f}"
    if key.endswith("error"):
        return f"{v:+.1%}"
    if key.startswith("idle") or key in ("cpu_steal", "repeat"):
        return f"{v:.0%}"
    return str(v)


def summary(rows: list[dict[str, Any]]) -> str:
    """Mean and largest |step error| over the rows that ran, against the 10% / 5% target."""
    errs = [(abs(r["step_error"]), r["config"]) for r in rows if r.get("step_error") is not None]
    if not errs:
        return "No configuration ran."
    mean = sum(e for e, _ in errs) / len(errs)
    worst, name = max(errs)
    over = sum(e > 0.10 for e, _ in errs)
    return (f"Mean |step error| {mean:.1%} over {len(errs)} rows (target 5%: "
            f"{'met' if mean <= 0.05 else 'missed'}); largest {worst:.1%} ({name}); "
            f"{over} row(s) over 10%." + repeatability_sentence(rows) + stolen_summary(rows))


def repeatability_sentence(rows: list[dict[str, Any]]) -> str:
    """The sentence on how far a row's runs lay apart (``repeat``), on average and at
    most: the measurement's own repeatability. With two runs a row, a simulator without
    error would read a mean |step error| of about half that: for two runs' levels
    t(1 + e1) and t(1 + e2) with e1, e2 independent and alike symmetric about 0, e1 + e2
    has the distribution of e1 - e2, so the mean |(e1 + e2) / 2| that the pooled figure
    misses by is half the mean gap |e1 - e2| (the drift since the calibration comes on
    top)."""
    got = [(r["repeat"], r.get("runs")) for r in rows
           if r.get("repeat") is not None and r.get("step_error") is not None]
    if not got:
        return ""
    mean = sum(g for g, _ in got) / len(got)
    text = (f" The runs of a row lay {mean:.1%} apart on average (largest "
            f"{max(g for g, _ in got):.0%}): the measurement's own repeatability")
    if all(n == 2 for _, n in got):
        text += (f"; from it alone a simulator without error would read a mean |step "
                 f"error| of about {mean / 2:.1%}, more with the machine's drift since "
                 "the calibration")
    return text + "."


def stolen_summary(rows: list[dict[str, Any]]) -> str:
    """The sentence on rows measured while a hypervisor took over STEAL_LIMIT of the
    CPU."""
    stolen = [r["cpu_steal"] for r in rows if (r.get("cpu_steal") or 0.0) > STEAL_LIMIT]
    if not stolen:
        return ""
    low, high = f"{min(stolen):.0%}", f"{max(stolen):.0%}"
    share = low if low == high else f"{low}–{high}"
    return (f" {len(stolen)} row(s) ran while the hypervisor took {share} of the CPU "
            f"(steal, limit {STEAL_LIMIT:.0%}): their times "
            "include waits for the CPU that the simulation knows of only as far as the "
            "calibration ran under the same steal (its share is in the header).")


def _calibration_steal(steal: float | None) -> str:
    return "" if steal is None else f" (calibrated with {steal:.0%} steal)"


def _section(rows: list[dict[str, Any]], header: dict[str, Any], model: str) -> list[str]:
    steps = header["steps"]
    steps = steps.get(model) if isinstance(steps, dict) else steps
    lines = [f"Validation on {header['device_name']} ({header['device']}, {header['threads']} "
             f"thread(s) per process), torch {header['torch']}, profile `{header['profile']}`"
             f"{_calibration_steal(header.get('calibration_steal'))}, "
             f"{header['date']}; model {model}, {header['micro_batches']} "
             f"micro-batches of {header['micro_batch_size']}, {_runs(header.get('repeats'))}"
             f"{steps} steps{_spanning(header.get('min_seconds'))}.", "",
             "| config | measured ms | simulated ms | step error | runs | repeat | "
             "compute error | idle measured | idle simulated | steal | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    keys = ("measured_ms", "simulated_ms", "step_error", "runs", "repeat", "compute_error",
            "idle_measured", "idle_simulated", "cpu_steal")
    for row in rows:
        cells = [row["config"], *(_fmt(row, k) for k in keys), row.get("note", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, "", summary(rows)]


def _runs(n: int | None) -> str:
    return ("median of " if not n or n == 1 else
            f"{n} runs back to back, the median of their pooled steps; each of ")


def _spanning(seconds: float | None) -> str:
    return f" or more, spanning at least {seconds:g} s" if seconds else ""


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """One table per model (rows without a model are ``header['model']``'s), each with
    its mean and largest |step error|."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(row.get("model") or header["model"], []).append(row)
    sections = [_section(r, header, m) for m, r in by_model.items()] or \
        [_section([], header, header["model"])]
    if header.get("recheck"):  # the machine after the last row (calibration/measured/recheck)
        sections.append([header["recheck"]])
    return "\n\n".join("\n".join(sec) for sec in sections) + "\n"


def write_table(out: Path, rows: list[dict[str, Any]], header: dict[str, Any]) -> list[Path]:
    from simulator.outputs.trace_export import atomic_output

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    paths = [out / "validation.csv", out / "validation.md"]
    for path, text in zip(paths, (buf.getvalue(), markdown(rows, header)), strict=True):
        with atomic_output(path) as tmp:
            tmp.write_text(text)
    return paths


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
    from calibration.microbench.calibrate import require_torch

    torch = require_torch()

    out = Path(args.out)
    devices = torch.cuda.device_count() if args.device == "cuda" else 2
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
    names = models(args.model)
    configs = select(configs_for(args.device, devices), args.only)
    check_profile(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    set_aside(out, ([] if args.profile else [f"profile-{args.device}.results.jsonl"])
              + ([] if args.no_recheck else ["recheck.results.jsonl"]))
    with StealMeter() as calibrating:  # the calibration and the host-cost runs after it
        profile = _profile(args, out)
    calibration_steal = profile_steal(profile) if args.profile else calibrating.share
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
    from calibration.host import cpu_name

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




def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "validation", help="measure fixed small configurations and compare each with "
        "its simulation (the README's validation table)",
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

"""``clustersim measure``: a real small-GPT training run under torchrun.

:func:`run_measure` validates the configuration, launches
:mod:`calibration.measured.parallel_worker` with ``python -m torch.distributed.run
--standalone`` (one process per TP x PP x DP rank, gloo on CPU, NCCL on CUDA)
and leaves in the output directory:

* ``measured.json`` - median step time after warm-up, every step time, the
  compute / communication split of one profiled step, peak memory per rank and
  the configuration that ran (written atomically by rank 0), and the share of
  the CPU a hypervisor took during the launch (``cpu_steal``, from
  ``/proc/stat``; None off Linux), with a warning above 5%;
* ``trace.json`` - rank 0's ``torch.profiler`` Chrome trace of that step
  (every rank's is under ``traces/``);
* ``scenario.yaml`` - the simulator scenario of the same run, for
  ``clustersim compare``;
* ``logs/`` - each rank's stdout/stderr, ``torchrun.log`` - the launcher's.

Every launch has a timeout (the whole process group is killed when it
expires) and a failed launch raises :class:`MeasureError` naming the failed
rank, its exit code and the tail of its log - never a hang.

The pieces: :mod:`calibration.measured.measure_config` (what may run),
:mod:`calibration.measured.measure_launch` (torchrun, timeouts, failure reports),
:mod:`calibration.measured.measure_scenario` (``scenario.yaml``),
:mod:`calibration.measured.measure_trace` (compute / communication split) and the
workers :mod:`calibration.measured.parallel_worker` (TP / PP / DP),
:mod:`calibration.measured.moe_worker` (``--experts``) and
:mod:`calibration.measured.cp_worker` (``--cp``).  None of them but the workers
imports torch at module level, so the CLI and the scenario writer work where
torch is not installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from calibration.host import STEAL_LIMIT, StealMeter
from calibration.measured.gpt_presets import PRESETS
from calibration.measured.measure_config import (
    DEFAULT_TIMEOUT_S,
    DEVICES,
    SCHEDULES,
    MeasureConfig,
    MeasureError,
    make_config,
    resolve_model,
    validate,
    write_json_atomic,
    write_text_atomic,
)
from calibration.measured.measure_launch import failure_message, launch, log_tail, torchrun_command
from calibration.measured.measure_scenario import (
    scenario_dict,
    scenario_name,
    scenario_yaml,
    system_name,
)

__all__ = [
    "MeasureConfig",
    "MeasureError",
    "add_parser",
    "failure_message",
    "log_tail",
    "make_config",
    "resolve_model",
    "run_config",
    "run_measure",
    "scenario_dict",
    "scenario_name",
    "scenario_yaml",
    "system_name",
    "torchrun_command",
    "validate",
]


def run_measure(tp: int, pp: int, dp: int, **options: Any) -> dict[str, Any]:
    """Run the small GPT with real TP/PP/DP under torchrun; returns ``measured.json``'s content.

    ``options`` are :func:`make_config`'s keywords (schedule, zero, micro_batches,
    micro_batch_size, model, steps, warmup, device, out_dir, threads, timeout_s,
    sequence_parallel, seed, powersgd_rank, experts, ep, cp), with its defaults. Raises
    ``ValueError`` for an impossible configuration (before launching) and
    :class:`MeasureError` when the launch fails or times out.
    """
    return run_config(make_config(tp=tp, pp=pp, dp=dp, **options))


def run_config(cfg: MeasureConfig) -> dict[str, Any]:
    """Launch a validated configuration and collect its outputs."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("measured.json", "trace.json", "scenario.yaml"):
        (out / stale).unlink(missing_ok=True)
    for stale_dir in ("logs", "traces"):
        shutil.rmtree(out / stale_dir, ignore_errors=True)
    config_path = out / "run_config.json"
    write_json_atomic(config_path, asdict(cfg))
    result_path = out / "measured.json"
    warnings: list[str] = []
    with StealMeter() as steal:
        try:
            launch(cfg, config_path)
        except MeasureError as exc:
            # Rank 0 writes measured.json (atomically) only after every rank has
            # reported, so a result on disk means the crash came in teardown.
            if not result_path.exists():
                raise
            warnings.append(f"a worker failed after the results were complete: {exc}")
    if not result_path.exists():
        raise MeasureError(
            f"measure: workers exited cleanly but wrote no {result_path}; see {out / 'logs'}"
        )
    measured = json.loads(result_path.read_text())
    # the whole launch's share (start-up included): a run on a VM whose hypervisor took
    # more than STEAL_LIMIT of the CPU is slowed by it, and its table row says so
    measured["cpu_steal"] = None if steal.share is None else round(steal.share, 4)
    if (steal.share or 0.0) > STEAL_LIMIT:
        warnings.append(f"the hypervisor took {steal.share:.0%} of the CPU time during the "
                        f"run (steal in /proc/stat, limit {STEAL_LIMIT:.0%}): its times read "
                        "slow; measure again on a quieter machine")
    if warnings:
        measured["warnings"] = [*measured.get("warnings", []), *warnings]
    write_json_atomic(result_path, measured)
    rank0_trace = out / "traces" / "trace_rank0.json"
    if rank0_trace.exists():
        shutil.copyfile(rank0_trace, out / "trace.json")
    write_text_atomic(out / "scenario.yaml", scenario_yaml(cfg, measured.get("device_name")))
    return measured


# --------------------------------------------------------------------------- CLI
EPILOG = """\
example (two CPU processes, pipeline of two stages, 1F1B):
  clustersim measure --tp 1 --pp 2 --dp 1 --schedule 1f1b --micro-batches 4 \\
      --model tiny-gpt --steps 5 --warmup 2 --device cpu --threads 1 --out runs/pp2
  writes runs/pp2/{measured.json,trace.json,scenario.yaml}; then compare it with
  clustersim compare runs/pp2 --profile PROFILE.yaml
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``measure`` subcommand to the ``clustersim`` CLI."""
    summary = "train a small GPT with real TP/PP/DP under torchrun and record step times"
    p = subparsers.add_parser(
        "measure",
        help=summary,
        description=summary + ", a profiler trace and the equivalent scenario",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _layout_flags(p)
    _model_flags(p)
    _variant_flags(p)
    _run_flags(p)
    p.set_defaults(func=_cli_main)


def _layout_flags(p: argparse.ArgumentParser) -> None:
    """The parallel layout: the degrees, the schedule, ZeRO and the micro-batches."""
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel degree (stages)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel degree")
    p.add_argument(
        "--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)"
    )
    p.add_argument(
        "--zero", type=int, choices=(0, 3), default=0, help="0: DDP, 3: FSDP2 fully_shard"
    )
    p.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches per step (default 4)"
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=2, help="samples per micro-batch (default 2)"
    )


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model preset and its sizes overridden."""
    p.add_argument(
        "--model",
        default="tiny-gpt",
        choices=sorted(PRESETS),
        help="model preset (default tiny-gpt; tiny-llama and llama-1b build Llama's block: "
        "RMSNorm, SwiGLU, rotary positions, grouped-query attention; llama-1b has Llama "
        "3.2 1B's sizes)",
    )
    for size in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "seq-len", "vocab"):
        note = " (ffn-hidden follows as 4 x hidden unless given)" if size == "hidden" else ""
        p.add_argument(
            f"--{size}", type=int, default=None, help=f"override the preset's {size}{note}"
        )


def _variant_flags(p: argparse.ArgumentParser) -> None:
    """What the run adds to the layout: sequence parallelism, PowerSGD, experts, CP and a
    straggler on purpose."""
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (needs tp > 1)",
    )
    p.add_argument(
        "--powersgd-rank",
        type=int,
        default=0,
        help="register PyTorch's PowerSGD DDP hook of this rank (dp > 1, zero 0, tp 1); "
        "it compresses from the first timed step (default 0: off)",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="replace every MLP by this many routed experts, top-2, capacity factor 1 "
        "(calibration/measured/moe_worker.py; tp 1, pp 1; default 0: dense)",
    )
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree, dividing dp (default 1)"
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each sequence split over this many ranks, K and V "
        "all-gathered (calibration/measured/cp_worker.py; tp 1, pp 1; default 1)",
    )
    p.add_argument(
        "--slow-rank", type=int, default=-1,
        help="make this rank a straggler: its compute takes --slowdown times as long "
        "(calibration/measured/slow_rank.py; default: none)",
    )
    p.add_argument(
        "--slowdown", type=float, default=2.0,
        help="with --slow-rank: K, how many times as long its compute takes (default 2)",
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    """How long it runs, where, and where its results go."""
    p.add_argument("--steps", type=int, required=True, help="timed steps (at least)")
    p.add_argument(
        "--min-seconds", type=float, default=0.0,
        help="time more steps than --steps where those span less than this many seconds, "
        "at their median pace (the same count on every rank; default 0: exactly --steps)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    p.add_argument("--device", choices=DEVICES, required=True, help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"launch timeout in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--out", required=True, help="output directory")


def _cli_main(args: argparse.Namespace) -> int:
    """Run ``measure``: 0 on success, 2 for bad arguments, 1 when the run fails."""
    overrides = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "ffn_hidden": args.ffn_hidden,
        "kv_heads": args.kv_heads,
        "seq_len": args.seq_len,
        "vocab": args.vocab,
    }
    try:
        result = run_measure(
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            schedule=args.schedule,
            zero=args.zero,
            micro_batches=args.micro_batches,
            model=resolve_model(args.model, overrides),
            steps=args.steps,
            warmup=args.warmup,
            device=args.device,
            out_dir=args.out,
            threads=args.threads,
            timeout_s=args.timeout,
            micro_batch_size=args.micro_batch_size,
            sequence_parallel=args.sequence_parallel,
            powersgd_rank=args.powersgd_rank,
            experts=args.experts,
            ep=args.ep,
            cp=args.cp,
            slow_rank=args.slow_rank,
            slowdown=args.slowdown if args.slow_rank >= 0 else 1.0,
            min_seconds=args.min_seconds,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except MeasureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"measured {scenario_name_from(result)}: step {result['step_time_s'] * 1e3:.1f} ms "
        f"(median of {len(result['step_times_s'])}), compute {result['compute_s'] * 1e3:.1f} ms, "
        f"comm {result['comm_s'] * 1e3:.1f} ms -> {args.out}"
    )
    for warning in result.get("warnings", []):
        print(f"WARNING: {warning}", file=sys.stderr)
    return 0


def scenario_name_from(result: dict[str, Any]) -> str:
    cp = f"-cp{result['cp']}" if result.get("cp", 1) > 1 else ""
    return f"tp{result['tp']}-pp{result['pp']}-dp{result['dp']}{cp}-{result['schedule']}"

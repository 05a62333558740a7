"""Launching the measured run under torchrun: timeouts, process groups, failure reports.

One ``python -m torch.distributed.run --standalone`` per run, in its own
session so that a timeout kills the launcher and every worker together.  Each
rank's stdout/stderr goes to ``logs/`` (torchrun ``--redirects 3``); when a
worker dies, torchrun's "Root Cause" names the rank and exit code, and the
error lines of that rank's log complete the one-line :class:`MeasureError`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from calibration.host import PACKAGE_ROOT, kill_process_group, worker_pythonpath
from calibration.measured.measure_config import MeasureConfig, MeasureError


def torchrun_command(cfg: MeasureConfig, config_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.world_size}",
        "--max-restarts=0",
        f"--log-dir={Path(cfg.out_dir) / 'logs'}",
        "--redirects=3",
        "-m",
        f"calibration.measured.{worker_module(cfg)}",
        "--config",
        str(config_path),
    ]


def worker_module(cfg: MeasureConfig) -> str:
    """The worker that runs ``cfg``: experts, context parallelism, or the TP/PP/DP GPT."""
    if cfg.experts:
        return "moe_worker"
    return "cp_worker" if cfg.cp > 1 else "parallel_worker"


def launch(cfg: MeasureConfig, config_path: Path) -> None:
    """Run torchrun to completion or raise :class:`MeasureError` (crash or timeout)."""
    out = Path(cfg.out_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = worker_pythonpath(env)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(cfg.threads)
    launcher_log = out / "torchrun.log"
    with launcher_log.open("w") as log:
        proc = subprocess.Popen(
            torchrun_command(cfg, config_path),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(PACKAGE_ROOT),
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            kill_process_group(proc)
            raise MeasureError(
                f"measure: run timed out after {cfg.timeout_s:g} s "
                f"(tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}) and was killed; "
                f"last log lines: {_tail_any_rank(out)}"
            ) from None
    if rc != 0:
        raise MeasureError(failure_message(out, rc))


def _rank_logs(out: Path, rank: int) -> list[Path]:
    return sorted((out / "logs").glob(f"**/attempt_*/{rank}/std*.log"))


_ERROR_LINE = re.compile(
    r"^([\w.]+(Error|Exception|Interrupt)\b|terminate called|what\(\)|Fatal Python error|Killed)"
)
_RANK_PREFIX = re.compile(r"^\[(default)?\d+\]:\s?|^\[rank\d+\]:\s?")


def log_tail(out: Path, rank: int, lines: int = 3, width: int = 300) -> str:
    """The end of one rank's log on one line: its error lines if any, else its last lines."""
    text: list[str] = []
    for path in _rank_logs(out, rank):  # stderr.log sorts before stdout.log
        text += [
            _RANK_PREFIX.sub("", ln).strip() for ln in path.read_text(errors="replace").splitlines()
        ]
        text = [ln for ln in text if ln]
        if text:
            break
    errors = [ln for ln in text if _ERROR_LINE.search(ln)]
    picked = (errors or text)[-lines:]
    return " | ".join(ln[:width] for ln in picked) if picked else "(no output)"


def _tail_any_rank(out: Path) -> str:
    ranks = sorted(
        {
            int(p.parent.name)
            for p in (out / "logs").glob("**/attempt_*/*/std*.log")
            if p.parent.name.isdigit()
        }
    )
    return "; ".join(f"rank {r}: {log_tail(out, r, 1)}" for r in ranks) or "(no worker logs)"


def failure_message(out: Path, rc: int) -> str:
    """One line: which rank failed first, its exit code, the end of its log."""
    launcher = (
        (out / "torchrun.log").read_text(errors="replace")
        if (out / "torchrun.log").exists()
        else ""
    )
    root = launcher.split("Root Cause", 1)[-1] if "Root Cause" in launcher else launcher
    rank_m = re.search(r"rank\s*:\s*(\d+)", root)
    code_m = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    if rank_m is None:
        tail = " | ".join([ln.strip() for ln in launcher.splitlines() if ln.strip()][-3:])
        return (
            f"measure: torchrun exited with code {rc}: {tail or '(no output)'} "
            f"(logs in {out / 'logs'})"
        )
    rank = int(rank_m.group(1))
    code = code_m.group(1) if code_m else str(rc)
    return (
        f"measure: worker rank {rank} failed with exit code {code}: {log_tail(out, rank)} "
        f"(logs in {out / 'logs'})"
    )

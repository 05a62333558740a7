"""The ``calibrate`` command's flags checked together and resolved into :class:`Options`:
the device (cuda when PyTorch sees a GPU), the dtype, the processes and threads, the
results file beside the profile, and the base preset for what is not measured (the
device's datasheet preset, :mod:`simulator.system.devices`, on a GPU; ``cpu-1thread`` on a
CPU). Every problem with the flags is reported at once, before torch is imported.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from calibration.host import cpu_name, require_torch
from simulator.errors import Problem, UserError
from simulator.system.devices import preset_for


@dataclass(frozen=True)
class Options:
    device: str
    dtype: str
    level: str
    nproc: int
    threads: int
    out: Path
    results: Path
    nccl_specs: tuple[str, ...]
    skip: frozenset[str]
    base: str
    name: str
    timeout_s: float
    retry_failed: bool
    device_name: str
    retry_busy: int = 0
    scenario: str | None = None  # --scenario: its model's GEMMs timed too


def resolve_options(args: argparse.Namespace) -> Options:
    """Check the flags together; every problem found is reported at once."""
    problems: list[Problem] = []
    if not args.out:
        problems.append(Problem("--out", None, "name the profile to write, e.g. --out cpu.yaml"))
    elif Path(args.out).suffix.lower() not in (".yaml", ".yml"):
        problems.append(Problem("--out", args.out, "the profile is YAML: end the name in .yaml"))
    elif Path(args.out).is_dir():
        problems.append(Problem("--out", args.out, "is a directory; name a .yaml file"))
    if args.threads < 1:
        problems.append(Problem("--threads", args.threads, "use 1 or more"))
    if args.nproc is not None and args.nproc < 1:
        problems.append(Problem("--nproc", args.nproc, "use 1 or more"))
    if not 0 <= args.retry_busy <= 10:
        problems.append(Problem("--retry-busy", args.retry_busy, "use 0 to 10 re-measures"))
    if args.timeout is not None and args.timeout <= 0:
        problems.append(Problem("--timeout", args.timeout, "use a positive number of seconds"))
    if args.from_nccl_tests and "collectives" in args.skip:
        problems.append(Problem("--skip", "collectives", "conflicts with --from-nccl-tests; "
                                "drop one of them"))
    problems += _scenario_problems(getattr(args, "scenario", None))
    if problems:
        raise UserError(problems)
    torch = require_torch()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError([Problem("--device", "cuda", "PyTorch sees no CUDA GPU here; use "
                                 "--device cpu (or check CUDA_VISIBLE_DEVICES and the driver)")])
    count = torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)
    nproc = args.nproc or (count if device == "cuda" else max(1, min(2, count // args.threads)))
    if device == "cuda" and nproc > count:
        raise UserError([Problem("--nproc", nproc, f"only {count} GPU(s) visible; use "
                                 f"--nproc {count} or fewer")])
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else cpu_name()
    base = args.base or (preset_for(device_name) or "dgx-h100" if device == "cuda"
                         else "cpu-1thread")
    out = Path(args.out)
    results = Path(args.results) if args.results else out.with_suffix(".results.jsonl")
    level = "tiny" if args.tiny else "quick" if args.quick else "full"
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")[:40]
    return Options(device, args.dtype or ("bf16" if device == "cuda" else "fp32"), level, nproc,
                   args.threads, out, results, tuple(args.from_nccl_tests or ()),
                   frozenset(args.skip), base, args.name or f"calibrated-{slug}",
                   args.timeout or (1800.0 if device == "cuda" else 300.0), args.retry_failed,
                   device_name, args.retry_busy, getattr(args, "scenario", None))


def _scenario_problems(path: str | None) -> list[Problem]:
    """``--scenario``: a file that loads as a scenario (its own problems, named)."""
    if path is None:
        return []
    if not Path(path).is_file():
        return [Problem("--scenario", path, "no such file; name a scenario YAML, e.g. "
                        "scenarios/llama2-7b-8gpu-ddp.yaml")]
    from simulator.spec.load import load_scenario

    try:
        load_scenario(path)
    except UserError as err:  # each of its problems on its own line
        return [Problem("--scenario", path, f"does not load: {line}") for line in err.lines()]
    return []

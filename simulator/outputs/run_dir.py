"""A run directory holds the files of exactly one run, listed in its ``manifest.json``.

``clustersim run`` checks the output directory before simulating (an existing
file, a path under a file, or a directory it cannot write is one line and exit
2, not a traceback after the whole simulation). The run then writes into a fresh
staging directory beside the target (``.NAME.staging-PID-ID``), and only when
every file is there does :func:`staged_run` move the set into place:

1. the old ``manifest.json`` goes first (from here on the directory is not a
   complete run, and ``plot`` says so),
2. the previous run's files (those its manifest listed, and any known output
   name) are removed, so a later ``--method analytic --no-plots`` run leaves no
   stale timeline, trace or PNG beside its ``results.json``,
3. the new files are renamed in, and the new manifest last.

The manifest names the generator, its version, a run id and every file with its
size and SHA-256; :func:`check_run_dir` (used by ``plot``) refuses a directory
whose files do not match it. The staging directory is removed whatever happens,
Ctrl-C included; one left by a killed process (its PID gone) is removed by the
next run into the same place. Other files a user keeps in the directory are
left alone.

The default output directory is ``out/<name>`` with the name reduced to letters,
digits, ``.``, ``_`` and ``-`` (:func:`default_out_dir`), so ``name: ../../x`` or
an absolute name stays under ``out/``. A run with ``--set`` overrides defaults to
``out/<name>-set-<digest>`` (:func:`run_out_dir`: eight hex digits of the overrides,
in order), so runs of one scenario with different overrides never share a
directory; a run into an ``--out`` that holds a run of a different scenario says so
on stderr, naming what differs (:func:`replaced_run_note`), before replacing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from simulator import __version__
from simulator.errors import Problem, UserError
from simulator.outputs.writing import output_lock

MANIFEST = "manifest.json"
#: Names a run writes; removed from a reused directory even when no manifest lists them.
KNOWN_OUTPUTS = ("results.json", "critical_path.parquet", "memory_timeline.parquet",
                 "time_breakdown.parquet", "timeline.csv", "timeline.parquet", "trace.json",
                 "trace.json.gz", "timeline.png", "breakdown.png", "memory.png", "report.html")
_STAGING = re.compile(r"^\.(?P<name>.+)\.staging-(?P<pid>\d+)-[0-9a-f]+$")


def default_out_dir(name: str) -> Path:
    """``out/<name>`` with the name made a single safe path component."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:100]
    return Path("out") / (safe or "run")


def run_out_dir(name: str, overrides: Sequence[str] = ()) -> Path:
    """``run``'s default directory: ``out/<name>``, or ``out/<name>-set-<digest>`` with
    overrides (the SHA-256 of the ``--set`` strings in order, eight hex digits)."""
    base = default_out_dir(name)
    if not overrides:
        return base
    digest = hashlib.sha256("\n".join(overrides).encode("utf-8", "surrogatepass")).hexdigest()
    return base.with_name(f"{base.name[:86]}-set-{digest[:8]}")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, Mapping):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def replaced_run_note(out: Path, scenario: Mapping[str, Any], shown: int = 3) -> str | None:
    """A line saying that ``out`` holds a complete run of another scenario (the keys
    that differ, old → new), or None (no run there, or the same scenario)."""
    from simulator.loading import read_json

    if not (out / MANIFEST).is_file() or not (out / "results.json").is_file():
        return None
    try:
        old = read_json(out / "results.json", "--out").get("scenario")
    except (UserError, AttributeError):
        return None
    before, after = _flat(old if isinstance(old, Mapping) else {}), _flat(scenario)
    keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if not keys:
        return None
    diffs = ", ".join(f"{k}: {before.get(k, '-')!r} → {after.get(k, '-')!r}"
                      for k in keys[:shown])
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return (f"note: {out} holds a run of a different scenario ({diffs}{more}); replacing it "
            "(give another --out to keep both)")


def check_out_dir(out: Path) -> None:
    """Refuse, before any simulation, an output path that cannot become a directory
    (:mod:`simulator.outputs.writing` names each reason)."""
    from simulator.outputs.writing import check_dir_destination

    check_dir_destination(out, "--out")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _entries(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (root / n).stat().st_size, "sha256": _sha256(root / n)}
            for n in sorted(names)}


def write_manifest(root: Path, names: list[str], run_id: str | None = None) -> Path:
    """Write ``root/manifest.json`` listing ``names`` (files in ``root``), atomically."""
    from simulator.outputs.trace_export import atomic_output

    manifest = {"generator": "clustersim", "version": __version__,
                "run_id": run_id or uuid.uuid4().hex,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": _entries(root, names)}
    with atomic_output(root / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return root / MANIFEST


def _remove_stale_staging(out: Path) -> None:
    """Staging directories of processes that no longer exist (a killed run)."""
    if not out.parent.is_dir():
        return
    for path in out.parent.iterdir():
        m = _STAGING.match(path.name)
        if not m or m["name"] != out.name or not path.is_dir():
            continue
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # alive under another user, or not ours to judge


def _previous_files(out: Path) -> set[str]:
    names = {n for n in KNOWN_OUTPUTS if (out / n).is_file()}
    # a missing or unreadable manifest lists nothing more than the known outputs
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        listed = json.loads((out / MANIFEST).read_text(encoding="utf-8"))["files"]
        names |= {n for n in listed if isinstance(n, str) and "/" not in n and n != MANIFEST}
    return names


@contextmanager
def staged_run(out: Path) -> Iterator[Path]:
    """Yield a fresh staging directory; on success its files replace ``out``'s run."""
    check_out_dir(out)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(out)
        staging.mkdir()
    except OSError as exc:
        raise UserError([Problem("--out", str(out), f"cannot be written ({exc.strerror or exc})"
                                 "; choose another --out")]) from None
    try:
        yield staging
        names = sorted(p.name for p in staging.iterdir() if p.is_file() and p.name != MANIFEST)
        write_manifest(staging, names)
        with output_lock(out):  # another run into the same place moves its set in first
            _move_in(staging, out, names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_in(staging: Path, out: Path, names: list[str]) -> None:
    """The staged files replace ``out``'s run, the manifest last (module notes)."""
    if not out.exists():
        staging.rename(out)  # a new directory: one rename
        return
    (out / MANIFEST).unlink(missing_ok=True)
    for name in _previous_files(out):
        (out / name).unlink(missing_ok=True)
    for name in names:
        (staging / name).replace(out / name)
    (staging / MANIFEST).replace(out / MANIFEST)


def check_run_dir(run_dir: Path) -> dict[str, Any]:
    """The manifest of a complete run in ``run_dir``; a UserError when files mismatch."""
    from simulator.loading import read_json

    fix = "run the scenario again (`clustersim run SCENARIO --out DIR`)"
    if not (run_dir / MANIFEST).is_file():
        what = "has no manifest.json: not a complete clustersim run" if run_dir.is_dir() \
            else "is not a directory"
        raise UserError([Problem("run_dir", str(run_dir), f"{what}; {fix}")])
    manifest = read_json(run_dir / MANIFEST, "run_dir")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or "results.json" not in files:
        raise UserError([Problem("run_dir", str(run_dir / MANIFEST), f"is not a clustersim "
                                 f"manifest; {fix}")])
    for name in KNOWN_OUTPUTS:
        if name not in files and (run_dir / name).exists():
            raise UserError([Problem("run_dir", str(run_dir / name), f"is not part of the run "
                                     f"{MANIFEST} describes (a file of another run); {fix}")])
    for name, entry in files.items():
        path = run_dir / str(name)
        ok = path.is_file() and isinstance(entry, dict) and \
            path.stat().st_size == entry.get("bytes") and _sha256(path) == entry.get("sha256")
        if not ok:
            raise UserError([Problem("run_dir", str(path), f"is missing or differs from what "
                                     f"{MANIFEST} recorded (cut short or replaced); {fix}")])
    return manifest

"""The results file: one JSON object per line, appended the moment a measurement is taken.

Why a log and not an in-memory table: a calibration on a real cluster takes long
enough to be interrupted (a node reboots, someone hits Ctrl-C, a collective
hangs). Every measurement — and every failure, with its error — is appended and
flushed as soon as it exists, so a rerun with the same file skips what is already
there and the fitter reads the same file whether the run finished or not.

A record always has ``key`` (what was measured, unique within a device/dtype/
thread setting), ``kind`` (gemm, attention, memory, collective), ``ok`` and, when
``ok`` is false, ``error``. Successful records carry ``time_s`` (the median over
repeats) and the size the fitter uses (``flops`` or ``bytes``). A half-written last
line (the process died mid-write) is ignored with a warning, never fatal.

Failure injection for tests: ``CLUSTERSIM_CALIBRATE_FAIL`` holds comma-separated
``fnmatch`` patterns; a measurement whose key matches raises before it runs, in
this process and in torchrun workers alike (the variable is inherited).
``CLUSTERSIM_CALIBRATE_HANG`` makes rank 0 of a collective hang instead, which
exercises the launcher's timeout.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from simulator.errors import Problem, UserError

FAIL_ENV = "CLUSTERSIM_CALIBRATE_FAIL"
HANG_ENV = "CLUSTERSIM_CALIBRATE_HANG"
#: record kinds that are parts of a measurement or pass markers, not measurements
PARTIAL_KINDS = ("pass", "collective_round")


class InjectedFailureError(RuntimeError):
    """Raised for a measurement named in ``CLUSTERSIM_CALIBRATE_FAIL`` (tests only)."""


def _matches(env: str, key: str) -> bool:
    patterns = [p.strip() for p in os.environ.get(env, "").split(",") if p.strip()]
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def check_injected_failure(key: str, may_hang: bool = False) -> None:
    """Raise for keys named in CLUSTERSIM_CALIBRATE_FAIL; hang on CLUSTERSIM_CALIBRATE_HANG."""
    if _matches(FAIL_ENV, key):
        raise InjectedFailureError(f"injected failure ({FAIL_ENV} matches {key})")
    if may_hang and _matches(HANG_ENV, key):
        time.sleep(3600)  # a deadlocked collective, as the launcher's timeout sees one


class ResultsStore:
    """Append-only JSONL measurements; ``done`` tells a resumed run what to skip."""

    def __init__(self, path: str | Path, retry_failed: bool = False) -> None:
        self.path = Path(path)
        self.retry_failed = retry_failed
        if self.path.exists() and not self.path.is_file():
            raise UserError([Problem("--results", str(self.path),
                                     "is not a regular file; name a .jsonl file")])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch(exist_ok=True)
        except OSError as exc:
            raise UserError([Problem("--results", str(self.path),
                                     f"cannot create it ({exc.strerror})")]) from None

    def records(self) -> list[dict[str, Any]]:
        """All parseable records, later ones after earlier ones."""
        return list(_read_jsonl(self.path))

    def latest(self) -> dict[str, dict[str, Any]]:
        """The last record per key (a retried failure is superseded by its success)."""
        out: dict[str, dict[str, Any]] = {}
        for rec in self.records():
            key = rec.get("key")
            if isinstance(key, str):
                out[key] = rec
        return out

    def done(self) -> set[str]:
        """Keys a resumed run must not measure again."""
        latest = self.latest()
        if self.retry_failed:
            return {k for k, r in latest.items() if r.get("ok")}
        return set(latest)

    def measured(self) -> set[str]:
        """Keys of whole measurements (a GEMM, a collective's size, a term...) a resumed run
        skips (:meth:`done`: failed ones too, unless ``retry_failed``), less the recheck
        markers and a collective's rounds (parts of one measurement)."""
        latest = self.latest()
        return {k for k in self.done() if latest[k].get("kind") not in PARTIAL_KINDS}

    def append(self, record: dict[str, Any]) -> None:
        append_record(self.path, record)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record and push it to disk before returning."""
    rec = {**record, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    line = json.dumps(rec, sort_keys=False, default=_jsonable) + "\n"
    with path.open("a+b") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:  # a torn last line (killed mid-write) must not swallow this record
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                line = "\n" + line
        fh.write(line.encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())


def failure_record(key: str, kind: str, exc: BaseException | str, **meta: Any) -> dict[str, Any]:
    error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    first = error.strip().splitlines()[0] if error.strip() else error
    return {"key": key, "kind": kind, "ok": False, "error": first[:500], **meta}


def measure_term(store: ResultsStore, key: str, kind: str, rank: int,
                 measure: Callable[[], dict[str, Any]], summary: Callable[[dict[str, Any]], str],
                 **meta: Any) -> None:
    """A term that the ranks of a group measure together (``measure`` runs on each):
    rank 0 appends the record and prints its ``summary``, or appends the failure if it
    raised (the term then stays the preset's)."""
    try:
        check_injected_failure(key)
        rec = measure()
    except Exception as exc:  # recorded and skipped
        if rank == 0:
            store.append(failure_record(key, kind, exc, **meta))
        return
    if rank == 0:
        rec = {"key": key, "kind": kind, "ok": True, **meta, **rec}
        store.append(rec)
        print(summary(rec), flush=True)


def latest_rounds(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest successful record that has rounds (a term measured in rounds)."""
    ok = [r for r in records if r.get("ok") and r.get("rounds")]
    return ok[-1] if ok else None


def link_of(rec: dict[str, Any]) -> str:
    """The link class a record was measured on (one node: ``intra_node``)."""
    return str(rec.get("link", "intra_node"))


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a results file, read only (the file is not created if absent)."""
    return list(_read_jsonl(path))


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    from simulator.loading import JSON_LIMIT_BYTES, decode_text, read_bytes

    if not path.exists():
        return
    text = decode_text(read_bytes(path, "--results", JSON_LIMIT_BYTES), "--results", str(path))
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            print(f"warning: {path}:{lineno}: ignoring an unreadable line "
                  "(an interrupted write?)", file=sys.stderr)
            continue
        if isinstance(rec, dict):
            yield rec


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def progress(stage: str, index: int, total: int, text: str) -> None:
    """One progress line on stderr, e.g. ``[gemm 12/40] 4096x4096x1024 ...``, written
    above the stage's progress bar where a terminal shows one (tqdm.write)."""
    from tqdm import tqdm

    tqdm.write(f"[{stage} {index}/{total}] {text}", file=sys.stderr)

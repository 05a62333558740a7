"""On-disk result cache for sweeps and plans: compute each scenario once.

A result is stored under the SHA-256 of the resolved scenario (every field after
presets and overrides, without its ``name`` and ``description``, which change no
figure), the hardware profile it resolved to (a preset file edited since is a
different key), the method and fidelity, and the simulator's version: the
package version plus a digest of its source files and presets, so a changed
cost model never serves an old figure. One small JSON file per result,
``ROOT/ab/abcdef....json``, written atomically and checked against its SHA-256
when read: an interrupted sweep or a full disk leaves whole entries or none, a
corrupted entry is computed again, and the next run computes only what is missing.

:func:`map_cached` is the loop sweeps and plans share: look every job up, send
the misses to a ``concurrent.futures.Executor`` (local processes or a Dask
cluster's), store each result as it arrives, and show a progress bar
(:func:`simulator.outputs.progress.progress_bar`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from simulator import __version__
from simulator.errors import Interrupted, UserError
from simulator.loading import decode_text, read_bytes
from simulator.outputs.progress import progress_bar
from simulator.outputs.writing import atomic_output
from simulator.spec.scenario import Scenario

_PACKAGE = Path(__file__).parent.parent  # the simulator package

Figures = dict[str, Any]


@functools.cache
def code_version() -> str:
    """``__version__`` plus a digest of the simulator's sources (every subpackage's) and
    bundled presets."""
    digest = hashlib.sha256()
    files = sorted([*_PACKAGE.rglob("*.py"), *_PACKAGE.glob("presets/*/*.yaml")])
    for path in files:
        digest.update(path.relative_to(_PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def scenario_key(s: Scenario, method: str, fidelity: str | None = None) -> str:
    """The cache key of ``s`` simulated by ``method`` (and ``fidelity`` for the engine)."""
    scenario = s.to_dict()
    scenario.pop("name", None)
    scenario.pop("description", None)
    payload = {"version": code_version(), "method": method,
               "fidelity": fidelity if method == "engine" else None,
               "scenario": scenario, "hardware": s.hardware.model_dump(mode="json")}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


ENTRY_LIMIT_BYTES = 1 << 20  # an entry is a few hundred bytes of figures


def _digest(key: str, figures_text: str) -> str:
    return hashlib.sha256(f"{key}\n{figures_text}".encode()).hexdigest()


class ResultCache:
    """Figures by key in a directory; counts what it served, stored and found corrupt.

    An entry is ``{"key", "sha256", "figures"}``, the digest over the key and the
    figures' JSON text: an entry cut short, edited, copied under another key or not
    ours at all is a miss (computed again and overwritten), never a figure served.
    Entries are written atomically (:func:`~simulator.outputs.writing.atomic_output`),
    so processes sharing a cache need no lock: each writes whole entries, and two
    writing one key write the same figures."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self.hits = 0
        self.stored = 0
        self.corrupt = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> Figures | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:  # bounded like every file read; NaN allowed (a figure may be missing)
            entry = json.loads(decode_text(read_bytes(path, "--cache", ENTRY_LIMIT_BYTES),
                                           "--cache", str(path)))
            figures = entry["figures"]
            ok = entry["key"] == key and isinstance(figures, dict) and \
                entry["sha256"] == _digest(key, json.dumps(figures))
        except (UserError, ValueError, RecursionError, KeyError, TypeError):
            ok = False
        if not ok:
            self.corrupt += 1  # computed again; put() replaces it
            return None
        self.hits += 1
        return dict(figures)

    def put(self, key: str, figures: Figures) -> None:
        # insertion order kept: a cached row has its columns in the computed row's order
        text = json.dumps(figures)  # NaN allowed: a figure may be missing
        entry = f'{{"key": "{key}", "sha256": "{_digest(key, text)}", "figures": {text}}}'
        with atomic_output(self._path(key), "--cache") as tmp:
            tmp.write_text(entry, encoding="utf-8")
        self.stored += 1


Job = tuple[str | None, tuple[Any, ...]]  # (cache key or None, arguments of the function)


#: how many times the jobs a dead worker took down are sent again before giving up
RESUBMITS = 3


def _dead_worker_errors() -> tuple[type[BaseException], ...]:
    """What a future raises when the process running it died: a local pool breaks
    (every pending future of it fails); Dask gives up on a task whose workers kept
    dying (after its own retries)."""
    try:
        from distributed import KilledWorker
    except ImportError:  # Dask is an optional extra
        return (BrokenProcessPool,)
    return (BrokenProcessPool, KilledWorker)


def map_cached(executor: Executor, fn: Callable[..., Figures], jobs: Sequence[Job],
               cache: ResultCache | None = None, desc: str = "points") -> list[Figures]:
    """``fn(*args)`` for every job, in job order; cached jobs are not submitted.

    Each result is stored as soon as it arrives, so an interrupted call keeps
    everything finished before the interruption: Ctrl-C or SIGTERM stops what is
    pending and raises :class:`~simulator.errors.Interrupted` saying how many are kept
    and that the same command resumes; the rerun says how many it takes from the
    cache. Jobs lost with a worker process that died are sent again (a broken local
    pool is replaced first where the executor can:
    :class:`~simulator.search.executors.RespawningPool`), at most :data:`RESUBMITS`
    times, so every job has exactly one result.
    """
    results: list[Figures | None] = [None] * len(jobs)
    todo = []
    for i, (key, _) in enumerate(jobs):
        hit = cache.get(key) if cache is not None and key is not None else None
        if hit is None:
            todo.append(i)
        else:
            results[i] = hit
    if cache is not None and len(todo) < len(jobs):
        print(f"{len(jobs) - len(todo)} of {len(jobs)} {desc} from the cache ({cache.root}); "
              f"computing {len(todo)}", file=sys.stderr)
    if todo:
        pending: dict[Future[Figures], int] = {}
        try:
            _compute(executor, fn, jobs, todo, results, cache, desc, pending)
        except KeyboardInterrupt as exc:
            _abort(executor)
            for future, i in pending.items():  # finished while the signal was handled
                if results[i] is None and future.done() and not future.cancelled() \
                        and future.exception() is None:
                    _store(results, jobs, cache, i, future.result())
            raise Interrupted(getattr(exc, "signal_name", "SIGINT"),
                              _resume_line(results, jobs, cache, desc)) from None
    done = [r for r in results if r is not None]
    assert len(done) == len(jobs), "every job has a result"
    return done


def _store(results: list[Figures | None], jobs: Sequence[Job], cache: ResultCache | None,
           i: int, value: Figures) -> None:
    """Cache, then record, job ``i``'s result: a signal that interrupts the write leaves
    the job unrecorded, so the interruption's harvest stores it again."""
    key = jobs[i][0]
    if cache is not None and key is not None:
        cache.put(key, value)
    results[i] = value


def _compute(executor: Executor, fn: Callable[..., Figures], jobs: Sequence[Job],
             todo: list[int], results: list[Figures | None], cache: ResultCache | None,
             desc: str, pending: dict[Future[Figures], int]) -> None:
    """Submit ``todo``, store each result as it arrives, resubmit what dead workers lost;
    ``pending`` holds the futures in flight (what an interruption harvests)."""
    dead = _dead_worker_errors()
    pending.update({executor.submit(fn, *jobs[i][1]): i for i in todo})
    with progress_bar(len(todo), desc) as bar:
        for attempt in range(RESUBMITS + 1):
            lost: list[int] = []
            for future in as_completed(pending):
                i = pending[future]
                try:
                    value = future.result()
                except dead:
                    lost.append(i)
                    continue
                _store(results, jobs, cache, i, value)
                bar.update()
            if not lost:
                return
            if attempt == RESUBMITS:
                raise RuntimeError(f"{len(lost)} {desc} lost with dead worker processes "
                                   f"{RESUBMITS + 1} times")
            print(f"a worker process died: sending its {len(lost)} {desc} again "
                  f"({attempt + 1} of {RESUBMITS})", file=sys.stderr)
            respawn = getattr(executor, "respawn", None)
            if respawn is not None:
                respawn()
            pending.clear()
            pending.update({executor.submit(fn, *jobs[i][1]): i for i in sorted(lost)})


def _abort(executor: Executor) -> None:
    """Stop the executor's pending and running work without waiting for it."""
    abort = getattr(executor, "abort", None)
    if abort is not None:
        abort()
    else:
        executor.shutdown(wait=False, cancel_futures=True)


def _resume_line(results: Sequence[Figures | None], jobs: Sequence[Job],
                 cache: ResultCache | None, desc: str) -> str:
    kept = sum(r is not None for r in results)
    if cache is None:
        return (f"{kept} of {len(jobs)} {desc} were done and none is kept (the cache is "
                "off): a rerun computes them all")
    return (f"{kept} of {len(jobs)} {desc} done and kept in the cache ({cache.root}); "
            f"run the same command again to compute the remaining {len(jobs) - kept}")

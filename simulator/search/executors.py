"""Where sweeps and plans run: local processes, or a Dask cluster.

Both hand out a ``concurrent.futures.Executor``, the only interface
:mod:`simulator.search.sweep` and :mod:`simulator.search.plan` use, so neither knows which it
got. ``--dask`` picks the backend:

- absent: a :class:`RespawningPool` of ``--workers`` processes (default: cores): a
  ``ProcessPoolExecutor`` that is replaced when one of its processes dies (a broken
  pool refuses all further work; :func:`simulator.search.cache.map_cached` then sends
  the lost jobs again) and that Ctrl-C stops without waiting for running work;
- ``local:W``: a ``distributed.LocalCluster`` of W single-threaded worker
  processes started for this command and closed after it;
- ``tcp://HOST:8786`` (or ``tls://``, ``ws://``, ...): an existing scheduler, which
  must have the same clustersim installed on its workers. Nothing is started or
  shut down there; the client disconnects at the end.

Dask is optional (``pip install clustersim[dask]``); asking for it without it
installed is a one-line user error.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from simulator.errors import Problem, UserError

T = TypeVar("T")
_SCHEMES = ("tcp://", "tls://", "ws://", "wss://", "inproc://", "ucx://")
CONNECT_TIMEOUT_S = 15


def parse_dask(spec: str) -> tuple[str, int | str]:
    """``local:W`` as ("local", W); a scheduler address as ("remote", address)."""
    if spec.startswith("local:"):
        text = spec.removeprefix("local:")
        if re.fullmatch(r"[0-9]{1,4}", text) and 0 < int(text) <= 1024:
            return "local", int(text)
        raise UserError([Problem("--dask", spec, "local:W needs a worker count W from 1 to "
                                 "1024, e.g. local:4")])
    if spec.startswith(_SCHEMES) and len(spec) > spec.index("://") + 3:
        return "remote", spec
    raise UserError([Problem("--dask", spec, "expected local:W (start W workers here) or a "
                             "scheduler address such as tcp://HOST:8786")])


class RespawningPool(Executor):
    """Local worker processes that survive one of them dying: :meth:`respawn` replaces
    the broken ``ProcessPoolExecutor`` (whose every pending future failed with
    ``BrokenProcessPool``) by a fresh one, and :meth:`abort` stops pending and running
    work at once (Ctrl-C: the worker processes are terminated, not waited for)."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._pool = ProcessPoolExecutor(max_workers=max_workers)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def pids(self) -> list[int]:
        """The worker processes' ids (started on the first submissions)."""
        return sorted(getattr(self._pool, "_processes", None) or {})

    def respawn(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ProcessPoolExecutor(max_workers=self.max_workers)

    def abort(self) -> None:
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


@contextmanager
def open_executor(dask: str | None = None, workers: int | None = None,
                  processes: bool = True) -> Iterator[Executor]:
    """The executor ``--dask`` / ``--workers`` ask for, closed on exit.

    ``processes=False`` runs a ``local:W`` cluster's workers as threads of this
    process (quick to start; for tests and small sweeps).
    """
    if dask is None:
        with RespawningPool(workers or os.cpu_count() or 1) as pool:
            yield pool
        return
    kind, arg = parse_dask(dask)
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise UserError([Problem("--dask", dask, "Dask is not installed; pip install "
                                 "'clustersim[dask]' or drop --dask")]) from None
    cluster: Any = None
    if kind == "local":
        cluster = LocalCluster(n_workers=int(arg), threads_per_worker=1, processes=processes,
                               dashboard_address=None, silence_logs=logging.ERROR)
    try:
        client = _connect(Client, cluster if cluster is not None else str(arg), dask)
        try:
            yield client.get_executor()
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()


def _connect(client_type: Any, target: Any, spec: str) -> Any:
    try:
        return client_type(target, timeout=f"{CONNECT_TIMEOUT_S}s")
    except (OSError, TimeoutError) as exc:
        raise UserError([Problem("--dask", spec, f"no Dask scheduler answered within "
                                 f"{CONNECT_TIMEOUT_S} s ({type(exc).__name__}); start one "
                                 "with `dask scheduler` or use local:W")]) from None

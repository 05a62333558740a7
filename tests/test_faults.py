"""Long work survives the world failing around it: a worker process killed by its pid,
Ctrl-C and SIGTERM sent for real.

- A local pool whose worker dies (SIGKILL) breaks: every job it lost is sent again to
  a fresh pool, each job gets exactly one result and the cache one entry per job.
- A Dask worker killed mid-run: the scheduler re-runs its task elsewhere; the results
  equal an undisturbed run's (slow: a LocalCluster of processes takes seconds to start).
- SIGINT / SIGTERM while points are computed: what finished stays in the cache, the
  message says how many and how to resume, the exit status is 130 / 143, and the rerun
  computes only the rest and says so. In process (a job signals its own process, the
  main thread is interrupted where it waits) and through the CLI (slow: a real sweep
  of engine runs, the signal sent from outside once the first point is cached).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from simulator.errors import Interrupted
from simulator.search.cache import ResultCache, map_cached
from simulator.search.executors import RespawningPool

ROOT = Path(__file__).resolve().parent.parent


def slow_square(x: int) -> dict[str, Any]:
    time.sleep(0.3)
    return {"x": x, "square": x * x}


def _kill_a_worker_when_started(pool: RespawningPool, after_s: float) -> threading.Thread:
    def kill() -> None:
        deadline = time.monotonic() + 30
        while not pool.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(after_s)
        os.kill(pool.pids()[0], signal.SIGKILL)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def test_a_killed_local_worker_loses_no_job_and_computes_none_twice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = ResultCache(tmp_path / "cache")
    jobs = [(f"key{i}", (i,)) for i in range(8)]
    pool = RespawningPool(2)
    try:
        killer = _kill_a_worker_when_started(pool, 0.45)  # after a first pair finished
        out = map_cached(pool, slow_square, jobs, cache, "points")
        killer.join()
    finally:
        pool.shutdown()
    assert out == [{"x": i, "square": i * i} for i in range(8)]
    assert cache.stored == 8  # one entry per job: none stored twice, none lost
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 8
    assert "a worker process died: sending its" in capsys.readouterr().err


def test_ctrl_c_keeps_what_finished_and_the_rerun_computes_the_rest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], collector_paused: None) -> None:
    """The third job sends SIGINT to this process: the main thread, waiting for
    results, is interrupted for real."""
    def job(x: int) -> dict[str, Any]:
        if x == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        return {"x": x}

    cache = ResultCache(tmp_path / "cache")
    jobs = [(f"key{i}", (i,)) for i in range(5)]
    with ThreadPoolExecutor(1) as pool, pytest.raises(Interrupted) as caught:
        map_cached(pool, job, jobs, cache, "points")
    assert caught.value.signal_name == "SIGINT"
    assert caught.value.message == (
        f"2 of 5 points done and kept in the cache ({cache.root}); run the same command "
        "again to compute the remaining 3")
    computed: list[int] = []

    def again(x: int) -> dict[str, Any]:
        computed.append(x)
        return {"x": x}

    capsys.readouterr()
    rerun = ResultCache(tmp_path / "cache")
    with ThreadPoolExecutor(1) as pool:
        out = map_cached(pool, again, jobs, rerun, "points")
    assert out == [{"x": i} for i in range(5)] and sorted(computed) == [2, 3, 4]
    assert (rerun.hits, rerun.stored) == (2, 3)
    assert f"2 of 5 points from the cache ({rerun.root}); computing 3" in capsys.readouterr().err


def test_a_signal_that_cuts_a_cache_write_loses_no_result(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          collector_paused: None) -> None:
    """Ctrl-C landing while a finished result is being written (seen under load in the
    full suite): the interruption's harvest writes it again, and the message counts only
    what the cache holds."""
    cache = ResultCache(tmp_path / "cache")
    real_put = cache.put
    cut: list[str] = []

    def put(key: str, figures: dict[str, Any]) -> None:
        if not cut:
            cut.append(key)
            raise KeyboardInterrupt  # the signal arrives inside the first write
        real_put(key, figures)

    monkeypatch.setattr(cache, "put", put)
    jobs = [(f"key{i}", (i,)) for i in range(3)]
    with ThreadPoolExecutor(1) as pool, pytest.raises(Interrupted) as caught:
        map_cached(pool, slow_square, jobs, cache, "points")
    kept = [key for key, _ in jobs if ResultCache(tmp_path / "cache").get(key) is not None]
    assert cut[0] in kept
    assert caught.value.message.startswith(f"{len(kept)} of 3 points done and kept")


def test_without_a_cache_the_message_says_nothing_is_kept(collector_paused: None) -> None:
    def job(x: int) -> dict[str, Any]:
        if x == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        return {"x": x}

    with ThreadPoolExecutor(1) as pool, pytest.raises(Interrupted, match="the cache is off"):
        map_cached(pool, job, [(None, (i,)) for i in range(3)], None, "points")


@pytest.mark.slow
def test_a_killed_dask_worker_changes_no_result() -> None:
    import logging

    import cloudpickle
    from distributed import Client, LocalCluster

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers lack tests/
    jobs = [(None, (i,)) for i in range(10)]
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.ERROR)
    try:
        with Client(cluster) as client:
            pids = sorted(client.run(os.getpid).values())
            killer = threading.Timer(0.8, os.kill, (pids[0], signal.SIGKILL))
            killer.start()
            out = map_cached(client.get_executor(), slow_square, jobs, None, "points")
            killer.join()
    finally:
        cluster.close()
    assert out == [{"x": i, "square": i * i} for i in range(10)]


def _sweep(out: Path, cache: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "simulator.cli", "sweep",
         str(ROOT / "scenarios" / "llama2-7b-8gpu-pp4-1f1b.yaml"),
         "--grid", "training.micro_batch=1,2", "--grid", "parallel.schedule=1f1b,gpipe",
         "--method", "engine", "--workers", "1", "--cache", str(cache), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signalled_sweep_resumes_where_it_stopped(tmp_path: Path, sig: int,
                                                    status: int) -> None:
    cache = tmp_path / "cache"
    proc = _sweep(tmp_path / "out", cache)
    deadline = time.monotonic() + 300
    while not list(cache.rglob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    kept = len(list(cache.rglob("*.json")))
    assert proc.returncode == status, err
    assert 1 <= kept < 4
    assert f"{kept} of 4 points done and kept in the cache" in err
    assert f"run the same command again to compute the remaining {4 - kept}" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "sweep.csv").exists()  # nothing half-written
    rerun = _sweep(tmp_path / "out", cache)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    assert f"{kept} of 4 points from the cache ({cache}); computing {4 - kept}" in err
    fresh = _sweep(tmp_path / "fresh", tmp_path / "fresh-cache")
    assert fresh.wait(timeout=600) == 0
    resumed = pd.read_csv(tmp_path / "out" / "sweep.csv")
    pd.testing.assert_frame_equal(resumed, pd.read_csv(tmp_path / "fresh" / "sweep.csv"))

"""Each class of hostile input, injected for real through the CLI: a FIFO, an over-long
name, ``~nosuchuser``, a 10^6-point grid, a 10^9-GPU world, a job that never ends, a
deep or out-of-range JSON, a directory as ``--csv``, a symlink loop, hand-parsed
digits, a full disk, a second writer of the same directory, a corrupted cache entry.

Every case ends in exit 2 within seconds, with one ``error:`` line naming the input
and the limit or the fix, and no file left under a final name (nor a temporary one).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzz_cli import run_one
from small_scenario import SMALL

ROOT = Path(__file__).parents[1]
TIME_CAP_S = 20.0  # each refusal comes before any long work


def refused(argv: list[str], *words: str) -> dict[str, Any]:
    """Run ``argv``; it must exit 2 in time with one error line holding ``words``."""
    case = run_one(argv)
    assert case["rc"] == 2, case
    err = case["stderr"]
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and all(ln.isprintable() for ln in err.splitlines()), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert case["seconds"] < TIME_CAP_S, case
    return case


def no_leftovers(root: Path, *finals: Path) -> None:
    """No temporary file anywhere under ``root`` and none of ``finals`` written."""
    leftovers = [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    for final in finals:
        assert not final.exists() or final.is_dir() or final.is_symlink(), final


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


# ------------------------------------------------------------ special files and paths

def test_a_fifo_is_refused_without_blocking(tmp_path: Path, scenario: Path, fifo: Path) -> None:
    refused(["validate", str(fifo)], "special file")
    os.mkfifo(tmp_path / "system.yaml")
    refused(["validate", str(scenario), "--set", f"cluster.system={tmp_path / 'system.yaml'}"],
            "special file")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "results.json")
    refused(["diff", str(run_dir), str(run_dir), "--out", str(tmp_path / "d")], "special file")
    refused(["ops", str(scenario), "--csv", str(fifo)], "--csv", "special file")
    no_leftovers(tmp_path, tmp_path / "d")


def test_names_the_file_system_cannot_hold(tmp_path: Path, scenario: Path) -> None:
    long = str(tmp_path / ("a" * 300 + ".yaml"))
    refused(["validate", long], "305 bytes", "255")
    refused(["ops", str(scenario), "--csv", long], "--csv", "305 bytes")
    refused(["ops", str(scenario), "--csv", "~nosuchuser/ops.csv"], "--csv", "~")
    refused(["validate", "~nosuchuser/s.yaml"], "scenario", "user")
    refused(["run", str(scenario), "--no-plots", "--out", "~nosuchuser/out"], "--out")
    refused(["diff", "~nosuchuser/a", "~nosuchuser/b"], "RUN_A")
    refused(["plot", str(tmp_path / ("b" * 300))], "run_dir", "300 bytes")
    no_leftovers(tmp_path)


@pytest.mark.parametrize("kind", ["directory", "file child", "symlink loop", "unwritable"])
def test_a_destination_that_cannot_be_a_file(tmp_path: Path, scenario: Path, kind: str) -> None:
    target = {"directory": tmp_path / "adir", "file child": scenario / "ops.csv",
              "symlink loop": tmp_path / "loop1", "unwritable": Path("/proc/ops.csv")}[kind]
    (tmp_path / "adir").mkdir()
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    words = {"directory": "is a directory", "file child": "which is a file",
             "symlink loop": "symlink loop", "unwritable": "cannot be written"}[kind]
    refused(["ops", str(scenario), "--csv", str(target)], "--csv", words)
    if kind != "directory":  # a directory is a fine --out
        refused(["run", str(scenario), "--method", "analytic", "--no-plots", "--out",
                 str(target)], "--out")
    no_leftovers(tmp_path, target)
    assert scenario.read_text() == SMALL


def test_a_non_utf8_path_prints(tmp_path: Path) -> None:
    name = os.fsencode(tmp_path) + b"/caf\xe9.yaml"
    Path(os.fsdecode(name)).write_text(SMALL)
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-m", "simulator.cli", "validate", name],
                          capture_output=True, env=env, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert b"caf\\udce9.yaml: ok" in proc.stdout and b"Traceback" not in proc.stderr


# ------------------------------------------------------------ untrusted files

@pytest.mark.parametrize(("text", "words"), [
    ("[" * 100 + "]" * 100, "nested deeper than 64"),
    ('{"step_time_s": 1e400, "step_breakdown_s": {}}', "beyond the range"),
    ('{"step_time_s": 1' + "0" * 400 + ', "step_breakdown_s": {}}', "401 digits"),
    ('{"step_time_s": 1.0, "step_breakdown_s": {"compute": 1.0}, "scenario": [1]}',
     "field scenario"),
    ('{"step_time_s": 1.0, "step_breakdown_s": {"compute": 1.0}, "critical_path_s": '
     '{"compute": "x"}}', "field critical_path_s.compute"),
    (b"\xff\xfe\x00\x00", "UTF-32"),
])
def test_diff_reads_results_through_the_bounded_reader(tmp_path: Path, text: str | bytes,
                                                       words: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = text if isinstance(text, bytes) else text.encode()
    (run_dir / "results.json").write_bytes(data)
    refused(["diff", str(run_dir), str(run_dir), "--out", str(tmp_path / "d")], "RUN_A",
            words)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(("name", "text", "words"), [
    ("plan.csv", "", "not a readable CSV"),
    ("plan.csv", "a,b\n1,2\n", "no column 'fits'"),
    ("sweep.csv", "\x00\x01binary", "binary"),
    ("sweep.csv", "error,step_time_s\n,fast\n", "column step_time_s"),
    ("sweep.json", '{"axes": "tp"}', "sweep.json: axes"),
    ("plan.json", '{"request": {"model": 7}}', "plan.json: request.model"),
])
def test_plot_reads_search_outputs_through_the_bounded_reader(
        tmp_path: Path, name: str, text: str, words: str) -> None:
    from simulator.outputs.run_files import TABLE_COLUMNS

    table = name.replace(".json", ".csv")
    columns = [c for group in TABLE_COLUMNS[table] for c in group]
    (tmp_path / table).write_text(",".join(columns) + "\n" + ",".join("1" for _ in columns)
                                  + "\n")  # well-formed, so that the file under test is read
    (tmp_path / name).write_text(text)
    refused(["plot", str(tmp_path)], words)
    no_leftovers(tmp_path, tmp_path / "heatmap.png", tmp_path / "pareto.png")


# ------------------------------------------------------------ bounded work

def test_a_million_point_grid_is_refused_before_it_is_made(tmp_path: Path,
                                                          scenario: Path) -> None:
    values = ",".join(str(i) for i in range(1, 1001))
    refused(["sweep", str(scenario), "--grid", f"parallel.tp={values}", "--grid",
             f"parallel.pp={values}", "--no-cache"], "1000 x 1000", "1,000,000",
            "--max-points")
    keys = ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.cp", "parallel.ep",
            "parallel.zero", "parallel.virtual_stages", "training.micro_batch",
            "training.global_batch", "model.layers", "model.hidden", "model.heads",
            "model.seq_len", "model.vocab", "cluster.nodes", "cluster.gpus_per_node")
    sixteen = ",".join(str(i) for i in range(1, 17))
    axes = [a for key in keys for a in ("--grid", f"{key}={sixteen}")]  # 16^16 = 2^64 points
    refused(["sweep", str(scenario), *axes, "--no-cache"], "1.84e+19", "--max-points")
    refused(["sweep", str(scenario), "--grid", "parallel.tp=1,2,4", "--max-points", "2",
             "--no-cache"], "3 sweep points")


def test_repeated_values_are_one_value() -> None:
    from simulator.cli.common import int_list
    from simulator.search.sweep import grid_size, parse_grid

    axes = parse_grid(["parallel.tp=1,1,2,1", "parallel.pp=4,4"])
    assert axes == {"parallel.tp": ["1", "2"], "parallel.pp": ["4"]} and grid_size(axes) == 2
    assert int_list("--micro-batches", "8,8,8,1,8") == (8, 1)


def test_a_billion_gpus(tmp_path: Path, scenario: Path) -> None:
    world = ["--set", "cluster.nodes=125000000", "--set", "parallel.tp=1", "--set",
             "parallel.pp=1", "--set", "parallel.dp=1000000000", "--set",
             "training.global_batch=1000000000", "--set", "training.micro_batch=1"]
    case = run_one(["validate", str(scenario), *world])
    assert case["rc"] == 0 and case["seconds"] < TIME_CAP_S, case  # no per-rank lists
    for method in ("analytic", "engine"):
        refused(["run", str(scenario), *world, "--method", method, "--no-plots", "--out",
                 str(tmp_path / "o")], "1,000,000,000", "--max-ranks")
    refused(["plan", "--model", "tiny-gpt", "--gpus", "1000000000", "--system",
             "dgx-a100-80gb", "--global-batch", "1000", "--out", str(tmp_path / "p")],
            "--gpus", "1,000,000,000")
    assert not (tmp_path / "o").exists() and not (tmp_path / "p").exists()


def test_a_plan_past_its_candidate_limit(tmp_path: Path) -> None:
    refused(["plan", "--model", "tiny-gpt", "--gpus", "8", "--system", "dgx-a100-80gb",
             "--global-batch", "64", "--max-candidates", "10", "--out", str(tmp_path / "p")],
            "more than 10 candidate", "--max-candidates")
    refused(["plan", "--model", "tiny-gpt", "--gpus", "8", "--system", "dgx-a100-80gb",
             "--global-batch", "2000000000", "--out", str(tmp_path / "p")],
            "--global-batch = 2000000000", "less than or equal")


@pytest.mark.parametrize("extra", [
    ["--tokens", "1e17"],  # billions of steps
    ["--tokens", "1e12", "--checkpoint-interval", "0.001"],  # a checkpoint every step
    ["--tokens", "1e12", "--set", "reliability.gpu_mtbf_h=0.001"],  # a failure every 3.6 s
])
def test_a_job_that_would_never_end_is_refused(tmp_path: Path, scenario: Path,
                                               extra: list[str]) -> None:
    refused(["train", str(scenario), "--method", "analytic", "--out", str(tmp_path / "t"),
             *extra], "--max-events")
    assert not (tmp_path / "t").exists()


def test_the_event_estimate_follows_the_simulation() -> None:
    """The expected interruptions (the geometric law the estimate rests on: failures in
    segments and in restarts) match the job model's, within a quarter over 20 runs."""
    from test_job import NO_FAILURES, _spec

    from simulator.job.events import expected_counts
    from simulator.job.lifecycle import run_job

    for rate in (1 / 3600, 1 / 300, 1 / 100):
        spec = _spec(steps=2_000, step_time_s=(1.0,), failures_per_s={**NO_FAILURES,
                                                                      "gpu": rate})
        runs = [run_job(spec, seed) for seed in range(20)]
        failures = np.mean([sum(r.failures.values()) for r in runs])
        want_tries, want_failures = expected_counts(spec)
        assert all(r.checkpoints == 40 for r in runs)  # one a segment that completes
        assert want_tries >= 40 * (1 + rate * 50)  # each segment tried e^(λT) times
        assert abs(failures - want_failures) <= 0.25 * want_failures + 2, (rate, failures,
                                                                           want_failures)


# ------------------------------------------------------------ options

@pytest.mark.parametrize(("argv", "words"), [
    (["sweep", "{s}", "--grid", "parallel.tp=1,2", "--workers", "-1"], "--workers"),
    (["sweep", "{s}", "--grid", "parallel.tp=1,2", "--workers", "²"], "--workers"),
    (["sweep", "{s}", "--grid", "parallel.tp=1,2", "--dask", "local:²"], "--dask"),
    (["plan", "--model", "tiny-gpt", "--gpus", "8", "--system", "dgx-a100-80gb",
      "--global-batch", "64", "--micro-batches", "²"], "--micro-batches = '²'"),
    (["plan", "--model", "tiny-gpt", "--gpus", "8", "--system", "dgx-a100-80gb",
      "--global-batch", "64", "--context-parallel", "1,١"], "--context-parallel"),
    (["run", "{s}", "--max-ranks", "0"], "--max-ranks"),
])
def test_options_that_int_would_refuse(scenario: Path, argv: list[str], words: str) -> None:
    refused([a.replace("{s}", str(scenario)) for a in argv], words)


# ------------------------------------------------------------ a full disk

def _fail_after(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Every text write stops with ENOSPC after ``nbytes`` bytes reached the file."""
    real = Path.write_text

    def write_text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        real(self, data[:nbytes], *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_full_disk_leaves_nothing_half_written(tmp_path: Path, scenario: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    csv = tmp_path / "ops.csv"
    csv.write_text("the previous table\n")
    _fail_after(monkeypatch, 100)
    refused(["ops", str(scenario), "--csv", str(csv)], "--csv", "No space left on device",
            "free there", "nothing was written")
    assert csv.read_text() == "the previous table\n"  # the old file, whole
    no_leftovers(tmp_path)


def test_a_full_disk_does_not_poison_the_cache(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from simulator.errors import UserError
    from simulator.search.cache import ResultCache

    cache = ResultCache(tmp_path / "cache")
    _fail_after(monkeypatch, 10)
    with pytest.raises(UserError, match="No space left"):
        cache.put("ab" * 32, {"step_time_s": 1.5})
    monkeypatch.undo()
    assert cache.get("ab" * 32) is None and cache.stored == 0
    no_leftovers(tmp_path)
    cache.put("ab" * 32, {"step_time_s": 1.5})
    assert cache.get("ab" * 32) == {"step_time_s": 1.5}


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(path)], capture_output=True, check=False,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_really_full_tmpfs(tmp_path: Path, scenario: Path) -> None:
    """ENOSPC from the kernel, where this machine lets a test mount a 64 KiB tmpfs."""
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "64k"):
        pytest.skip("no tmpfs mount here (needs root)")
    try:
        (disk / "fill").write_bytes(b"\0" * (64 << 10))  # every page
        refused(["ops", str(scenario), "--csv", str(disk / "ops.csv")], "--csv",
                "No space left on device", "bytes free there")
        assert sorted(p.name for p in disk.iterdir()) == ["fill"]
    finally:
        subprocess.run(["umount", str(disk)], check=False, timeout=10)


# ------------------------------------------------------------ two writers, the cache

def test_a_second_writer_of_the_same_out_waits_then_refuses(
        tmp_path: Path, scenario: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import simulator.outputs.writing as writing

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / '.out.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(writing, "LOCK_WAIT_S", 0.5)
        start = time.monotonic()
        refused(["run", str(scenario), "--method", "analytic", "--no-plots", "--out",
                 str(out)], "--out", f"pid {holder.pid}", "still writing")
        assert time.monotonic() - start >= 0.5
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert run_one(["run", str(scenario), "--method", "analytic", "--no-plots", "--out",
                    str(out)])["rc"] == 0  # the holder gone, the lock is free
    assert (out / "results.json").is_file()


def test_a_corrupted_cache_entry_is_computed_again(tmp_path: Path) -> None:
    from simulator.search.cache import ResultCache

    cache = ResultCache(tmp_path)
    key = "cd" * 32
    cache.put(key, {"step_time_s": 1.5, "mfu": float("nan")})
    path = next(tmp_path.rglob("*.json"))
    entry = json.loads(path.read_text())
    assert entry["key"] == key and len(entry["sha256"]) == 64
    for bad in (path.read_text().replace("1.5", "0.5"),  # a figure edited
                path.read_text()[:-10],  # cut short
                json.dumps({"step_time_s": 0.5}),  # an entry of the old format
                "\0" * 10):
        path.write_text(bad)
        assert cache.get(key) is None
    assert cache.corrupt == 4 and cache.hits == 0
    cache.put(key, {"step_time_s": 1.5})
    assert cache.get(key) == {"step_time_s": 1.5}


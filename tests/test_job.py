"""The job over days: closed forms (no failures, Young/Daly), determinism, the
Llama 3 rates, checkpoint sizes, and `clustersim train` end to end."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simulator.cli.main import main
from simulator.job.lifecycle import JobSpec, run_job, run_many
from simulator.job.reliability import (
    CheckpointCost,
    checkpoint_bytes,
    checkpoint_cost,
    daly_interval,
    job_rates,
    young_interval,
)
from simulator.job.train import choose_interval, job_spec
from simulator.model.transformer import param_count
from simulator.spec.load import scenario_from_dict

NO_FAILURES = {"gpu": 0.0, "host": 0.0, "nic": 0.0, "switch": 0.0, "software": 0.0}


def _spec(**kw: object) -> JobSpec:
    base = JobSpec(steps=1000, step_time_s=(2.0,), checkpoint_every=50,
                   checkpoint=CheckpointCost(1e12, 5.0, 5.0, 10.0), restart_s=60.0,
                   failures_per_s=dict(NO_FAILURES))
    return replace(base, **kw)  # type: ignore[arg-type]


def _scenario(nodes: int = 2, **sections: object) -> object:
    return scenario_from_dict({
        "name": "t", "model": {"preset": "llama3-8b"},
        "cluster": {"system": "dgx-h100", "nodes": nodes},
        "parallel": {"tp": 8, "pp": 1, "dp": nodes},
        "training": {"global_batch": 8 * nodes}, **sections})


def test_no_failures_goodput_is_one_minus_checkpoint_overhead() -> None:
    run = run_job(_spec(), seed=3)
    # 1000 steps of 2 s and 20 synchronous checkpoints of 5 s, exactly
    assert run.wall_s == 1000 * 2.0 + 20 * 5.0
    assert run.checkpoints == 20
    assert run.goodput == 1 - run.checkpoint_s / run.wall_s == 2000 / 2100


def test_no_failures_async_costs_only_the_snapshot_and_the_last_write() -> None:
    spec = _spec(checkpoint=CheckpointCost(1e12, 0.5, 10.0, 10.0))
    run = run_job(spec, seed=0)
    # each checkpoint stalls 0.5 s (the write of 9.5 s more ends before the next one);
    # the job ends when the last one is safe: 9.5 s after its snapshot
    assert run.wall_s == pytest.approx(2000 + 20 * 0.5 + 9.5, rel=1e-12)
    assert run.goodput == pytest.approx(2000 / run.wall_s, rel=1e-12)
    assert run.goodput == pytest.approx(1 - run.checkpoint_s / run.wall_s, rel=1e-12)
    # writes longer than the interval stall the next checkpoint for the rest of them
    slow = run_job(_spec(checkpoint=CheckpointCost(1e12, 0.5, 150.0, 10.0)), seed=0)
    assert slow.wall_s == pytest.approx(20 * 150.0 + 100.0, rel=1e-12)
    assert slow.checkpoint_s == pytest.approx(slow.wall_s - 2000, rel=1e-12)


def test_mean_loss_per_failure_matches_young_daly_expectation() -> None:
    tau, restart, reload = 100.0, 50.0, 10.0
    spec = _spec(steps=400_000, step_time_s=(1.0,), checkpoint_every=100,
                 checkpoint=CheckpointCost(1e12, 0.0, 0.0, reload), restart_s=restart,
                 failures_per_s={**NO_FAILURES, "gpu": 1 / 4000})
    runs = run_many(spec, range(3))
    lost = np.concatenate([r.lost_work_s for r in runs])
    n = sum(sum(r.failures.values()) for r in runs)
    assert n > 250
    sigma = lost.std() / math.sqrt(len(lost))
    # unsaved work is uniform over the interval: mean τ/2 within Monte Carlo error
    assert abs(lost.mean() - tau / 2) < 4 * sigma
    per_failure = (lost.sum() + sum(r.restart_s for r in runs)) / n
    # the restarts add R + reload each (more only when a failure hits a restart)
    assert abs(per_failure - (tau / 2 + restart + reload)) < 4 * sigma + 2.0
    assert runs[0].mean_loss_per_failure_s == pytest.approx(
        (sum(runs[0].lost_work_s) + runs[0].restart_s) / sum(runs[0].failures.values()))


def test_young_and_daly_closed_forms() -> None:
    assert young_interval(2.0, 3600.0) == pytest.approx(120.0)
    assert daly_interval(2.0, 3600.0) == pytest.approx(118.0)
    assert daly_interval(10.0, 4.0) == 4.0  # δ ≥ 2M: checkpoint every M
    assert young_interval(5.0, math.inf) == math.inf


def test_simulated_interval_is_near_young() -> None:
    spec = _spec(steps=200_000, step_time_s=(1.0,), checkpoint=CheckpointCost(1e12, 2.0, 2.0, 5.0),
                 failures_per_s={**NO_FAILURES, "gpu": 1 / 3600})
    chosen, info = choose_interval(spec, "auto", scan_seeds=4)
    assert info["young_s"] == pytest.approx(120.0)
    assert 120 / 2 <= chosen.checkpoint_every <= 120 * 2
    assert max(p["goodput"] for p in info["scan"]) == pytest.approx(
        next(p["goodput"] for p in info["scan"] if p["every_steps"] == chosen.checkpoint_every))
    young, _ = choose_interval(spec, "young")
    assert young.checkpoint_every == 120


def test_deterministic_with_a_seed() -> None:
    spec = _spec(steps=20_000, failures_per_s={**NO_FAILURES, "gpu": 1 / 2000, "host": 1e-4},
                 planned_per_s=1e-4, step_time_s=(1.5, 2.0, 2.5))
    a, b, c = run_job(spec, 11, trace=True), run_job(spec, 11, trace=True), run_job(spec, 12)
    assert a.wall_s == b.wall_s and a.events == b.events and a.failures == b.failures
    assert a.wall_s != c.wall_s
    assert a.planned > 0 and sum(a.failures.values()) > 0


def test_llama3_preset_reproduces_the_report_at_its_scale() -> None:
    s = _scenario(nodes=2048)  # 16,384 H100 in 2,048 hosts, as in the report
    rates = job_rates(s)  # type: ignore[arg-type]
    hours = 54 * 24
    assert rates.failure_rate_per_h * hours == pytest.approx(419)
    assert rates.planned_per_h * hours == pytest.approx(47)
    assert rates.failures_per_h["gpu"] * hours == pytest.approx(148 + 72 + 19 + 17 + 6 + 6)
    small = job_rates(_scenario(nodes=256))  # type: ignore[arg-type]
    assert small.mtbf_h == pytest.approx(8 * rates.mtbf_h)  # 8× fewer components
    none = job_rates(_scenario(reliability={"preset": "none", "gpu_mtbf_h": 1000.0}))  # type: ignore[arg-type]
    assert none.failures_per_h == {**NO_FAILURES, "gpu": 16 / 1000}


def test_checkpoint_is_weights_and_optimizer_states_once() -> None:
    s = _scenario(checkpoint={"storage_write_GBps": 100.0, "asynchronous": True})
    psi = param_count(s.model)  # type: ignore[attr-defined]
    assert checkpoint_bytes(s) == 14 * psi  # type: ignore[arg-type]
    cost = checkpoint_cost(s)  # type: ignore[arg-type]
    assert cost.blocking_s == pytest.approx(14 * psi / 16 / 50e9)  # a rank's share over PCIe
    assert cost.durable_s == pytest.approx(cost.blocking_s + 14 * psi / 100e9)


@pytest.mark.parametrize(("stack", "per_param"), [
    ({"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, 2 + 4 + 2 + 2),  # BF16 moments
    ({"autocast": True}, 4 + 4 + 4),  # fp32 parameters are their own master copy
    ({"param_remainders": True}, 2 + 2 + 4 + 4),  # int16 remainders for the master
])
def test_checkpoint_holds_the_states_in_the_stacks_widths(stack: dict, per_param: int) -> None:
    """The checkpoint is the memory model's unique states: a stack's optimizer-state
    dtypes and autocast's fp32 parameters change its size (not a fixed 14 B/param)."""
    s = _scenario(stack={"preset": "megatron-core", **stack})
    psi = param_count(s.model)  # type: ignore[attr-defined]
    assert checkpoint_bytes(s) == per_param * psi  # type: ignore[arg-type]


def test_scenario_job_without_failures_is_exact() -> None:
    s = _scenario(reliability={"preset": "none"})
    spec = job_spec(s, 16 * 8192 * 100, [3.0], every=10)  # type: ignore[arg-type]
    run = run_job(spec, 0)
    delta = spec.checkpoint.blocking_s
    assert spec.steps == 100 and run.wall_s == pytest.approx(300 + 10 * delta, rel=1e-12)
    assert run.goodput == pytest.approx(1 - 10 * delta / run.wall_s, rel=1e-12)


SMALL = """\
name: small-train
model: {preset: tiny-gpt}
cluster: {system: dgx-a100-80gb, nodes: 1, gpus_per_node: 8}
parallel: {tp: 2, pp: 2, dp: 2, schedule: 1f1b}
training: {global_batch: 16, micro_batch: 2, dtype: bf16}
reliability: {gpu_mtbf_h: 2.0}
checkpoint: {storage_write_GBps: 0.01}
"""


def test_train_cli_writes_percentiles_and_figure(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    # no host cost per kernel: a launch-bound tiny model's step is so short that three
    # seeds' failures spread the days beyond the breakdown's 5%
    path.write_text(SMALL + "stack: {host_overhead_us: 0.0}\n")
    out = tmp_path / "out"
    assert main(["train", str(path), "--tokens", "2e9", "--seeds", "3", "--method", "analytic",
                 "--out", str(out)]) == 0
    res = json.loads((out / "train.json").read_text())
    for key in ("time_to_train_days", "goodput", "gpu_hours", "energy_MWh", "cost_usd"):
        p = res[key]
        assert p["p5"] <= p["p50"] <= p["p95"] and p["p5"] > 0
    days = res["time_to_train_days"]["p50"]
    assert res["gpu_hours"]["p50"] == pytest.approx(days * 24 * 8)
    assert res["cost_usd"]["p50"] == pytest.approx(res["gpu_hours"]["p50"] * 2.0)
    assert res["energy_MWh"]["p50"] == pytest.approx(days * 24 * (8 * 400 + 3300) * 1.1 / 1e6)
    timeline = pd.read_csv(out / "train_timeline.csv")
    assert timeline["steps"].iloc[-1] == res["steps"]  # the median run trains every step
    assert (out / "train.png").stat().st_size > 10_000
    assert "time to train" in capsys.readouterr().out
    parts = res["breakdown_days"]
    assert sum(parts.values()) == pytest.approx(res["time_to_train_days"]["p50"], rel=0.05)
    (out / "train.png").unlink()
    assert main(["plot", str(out)]) == 0  # re-drawn from the files alone
    assert (out / "train.png").is_file()


@pytest.mark.parametrize(("args", "field"), [
    (["--tokens", "-1"], "--tokens = -1.0"),
    (["--tokens", "1e9", "--set", "checkpoint.storage_write_GBps=0"],
     "checkpoint.storage_write_GBps = 0"),
    (["--tokens", "1e9", "--checkpoint-interval", "often"], "--checkpoint-interval = 'often'"),
    (["--tokens", "1e9", "--seeds", "0"], "--seeds = 0"),
    (["--tokens", "1e9", "--set", "checkpoint.interval=-5"], "checkpoint.interval = -5"),
    (["--tokens", "1e9", "--set", "reliability.gpu_mtbf_h=0"], "reliability.gpu_mtbf_h = 0"),
    (["--tokens", "1e9", "--set", "cluster.system=cpu-1thread",
      "--set", "cluster.gpus_per_node=8"], "cost.gpu_power_W"),
])
def test_train_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], field: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    proc = subprocess.run([sys.executable, "-m", "simulator.cli", "train", str(path), *args],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], lines


@pytest.mark.parametrize("durable_s", [3.0, 150.0])  # synchronous, asynchronous
def test_wall_time_parts_add_up_with_failures_restarts_and_planned_stops(
        durable_s: float) -> None:
    spec = _spec(steps=50_000, checkpoint=CheckpointCost(1e12, 3.0, durable_s, 20.0),
                 failures_per_s={**NO_FAILURES, "gpu": 1 / 3000, "switch": 1 / 9000},
                 planned_per_s=1 / 20_000, restart_s=400.0)
    for seed in range(3):
        run = run_job(spec, seed)
        assert sum(run.failures.values()) > 10 and run.planned > 0
        assert sum(run.breakdown_s.values()) == pytest.approx(run.wall_s, rel=1e-9)


def test_scan_never_goes_below_its_checkpoint_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import simulator.job.train as train

    monkeypatch.setattr(train, "SCAN_MAX_CHECKPOINTS", 100)
    # a tiny checkpoint cost: Young's interval is under one step
    spec = _spec(steps=20_000, step_time_s=(1.0,), checkpoint=CheckpointCost(1e9, 1e-4, 1e-4, 1.0),
                 failures_per_s={**NO_FAILURES, "gpu": 1 / 3600})
    chosen, info = choose_interval(spec, "auto", scan_seeds=2)
    assert info["young_s"] < 1 and info["scan_floor_steps"] == 200
    assert all(p["every_steps"] >= 200 for p in info["scan"])
    assert chosen.checkpoint_every >= 200


def test_plot_of_a_broken_train_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.json").write_text('{"scenario": "x"}')
    (tmp_path / "train_timeline.csv").write_text("time_s,steps\n0,0\n")
    proc = subprocess.run([sys.executable, "-m", "simulator.cli", "plot", str(tmp_path)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "not a clustersim train output" in proc.stderr


#: ``clustersim`` in a process that takes Ctrl-C even where the test runs with SIGINT
#: ignored (a background job inherits that, and Python then installs no handler)
SIGNALLABLE_CLI = (sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                   "signal.default_int_handler); from simulator.cli.main import main; "
                   "sys.exit(main())")


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signalled_train_says_what_it_did_and_leaves_no_output(
        tmp_path: Path, sig: int, status: int) -> None:
    """A real ``clustersim train`` signalled while its Monte Carlo runs go: exit 130 / 143,
    one line with the stages done and the runs finished, nothing under --out."""
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*SIGNALLABLE_CLI, "train", str(path), "--tokens", "2e9",
         "--seeds", "100000", "--method", "analytic", "--checkpoint-interval", "young",
         "--max-events", "2000000000", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the signal once the runs have started
        seen.append(line)
        if line.startswith("running the job"):
            break
    time.sleep(0.5)
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=60)
    name = "SIGINT" if sig == signal.SIGINT else "SIGTERM"
    assert proc.returncode == status, "".join(seen) + rest
    [line] = rest.strip().splitlines()
    match = re.fullmatch(
        rf"interrupted \({name}\): one step simulated \([\d.e+-]+ s\); checkpoint interval "
        rf"chosen \([\d,]+ s\); (\d+) of 100000 job runs done; nothing written to "
        rf"{re.escape(str(out))} by this run \(no file is left half-written\); train keeps "
        r"no partial runs: run the same command again", line)
    assert match, line
    assert int(match[1]) < 100000
    assert not out.exists() or not any(out.iterdir())

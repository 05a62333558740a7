"""``clustersim measure``: real TP/PP/DP runs of the small GPT on CPU (gloo, world size 2).

Each launch is a torchrun of two one-thread processes on a tiny model, a few
seconds each.  The fast tests at the top need no launch (and no torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from calibration.measured.measure import (
    MeasureError,
    add_parser,
    failure_message,
    make_config,
    run_measure,
    scenario_yaml,
    system_name,
)
from calibration.measured.measure_trace import breakdown_from_trace, subtract, union

TINY = {"layers": 4, "hidden": 32, "heads": 2, "ffn_hidden": 64, "vocab": 64, "seq_len": 16}
RUN: dict[str, Any] = {"micro_batches": 2, "model": TINY, "steps": 2, "warmup": 1, "device": "cpu"}

MODES: dict[str, dict[str, Any]] = {
    "dp2-ddp": {"tp": 1, "pp": 1, "dp": 2},
    "pp2-gpipe": {"tp": 1, "pp": 2, "dp": 1, "schedule": "gpipe"},
    "pp2-1f1b": {"tp": 1, "pp": 2, "dp": 1, "schedule": "1f1b"},
    "tp2": {"tp": 2, "pp": 1, "dp": 1},
    "dp2-fsdp": {"tp": 1, "pp": 1, "dp": 2, "zero": 3},
    "pp2-interleaved": {"tp": 1, "pp": 2, "dp": 1, "schedule": "interleaved"},
    "tp2-sp": {"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": True},
}


# --------------------------------------------------------------------------- no launch
def test_scenario_yaml_matches_the_documented_layout(tmp_path: Path) -> None:
    cfg = make_config(
        tp=1,
        pp=2,
        dp=1,
        schedule="1f1b",
        micro_batches=4,
        micro_batch_size=2,
        model="tiny-gpt",
        out_dir=tmp_path,
    )
    assert scenario_yaml(cfg) == (
        "name: measured-tp1-pp2-dp1-1f1b\n"
        "stack: pytorch-eager\n"
        "model: {layers: 4, hidden: 128, heads: 4, kv_heads: 4, ffn_hidden: 512, vocab: 512, "
        "seq_len: 64, activation: gelu, norm: layernorm, bias: true, tied_embeddings: true, "
        "position: learned}\n"
        "cluster: {system: cpu-1thread, nodes: 1, gpus_per_node: 2}\n"
        "parallel: {tp: 1, pp: 2, dp: 1, schedule: 1f1b, virtual_stages: 1, zero: 0, "
        "recompute: none, sequence_parallel: false}\n"
        "training: {global_batch: 8, micro_batch: 2, dtype: fp32}\n"
    )


def test_scenario_validates_with_the_simulator(tmp_path: Path) -> None:
    scenario = pytest.importorskip("simulator.spec.load")
    cfg = make_config(
        tp=2, pp=2, dp=2, schedule="interleaved", zero=3, micro_batches=4, out_dir=tmp_path
    )
    path = tmp_path / "scenario.yaml"
    path.write_text(scenario_yaml(cfg))
    s = scenario.load_scenario(path)
    assert (s.parallel.tp, s.parallel.pp, s.parallel.dp) == (2, 2, 2)
    assert s.parallel.virtual_stages == 2
    # the measured run is plain PyTorch eager: its stack, not the default (megatron-core)
    assert s.stack.name == "pytorch-eager"
    assert s.stack.optimizer == "per_tensor" and s.stack.attention == "flash2"
    assert s.training.global_batch == 2 * 4 * 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tp": 1, "pp": 3, "dp": 1}, "model.layers=4"),
        ({"tp": 8, "pp": 1, "dp": 1}, "model.heads=4"),
        ({"tp": 1, "pp": 2, "dp": 1, "micro_batches": 1}, "micro_batches=1"),
        ({"tp": 1, "pp": 1, "dp": 1, "schedule": "zb"}, "schedule='zb'"),
        ({"tp": 1, "pp": 1, "dp": 2, "zero": 2}, "zero=2"),
        ({"tp": 1, "pp": 1, "dp": 1, "schedule": "interleaved"}, "schedule=interleaved"),
        ({"tp": 1, "pp": 1, "dp": 1, "model": {**TINY, "layer": 2}}, "unknown key"),
        ({"tp": 1, "pp": 1, "dp": 1024, "device": "cuda"}, "tp*pp*dp*cp=1024"),
        ({"tp": 1, "pp": 1, "dp": 1, "min_seconds": -1}, "min_seconds=-1"),
        ({"tp": 1, "pp": 1, "dp": 1, "min_seconds": 900, "timeout_s": 600}, "min_seconds=900"),
    ],
)
def test_bad_arguments_are_one_line_value_errors(
    kwargs: dict[str, Any], field: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r".") as info:
        run_measure(**{"out_dir": tmp_path, **kwargs})
    message = str(info.value)
    assert field in message and "\n" not in message
    assert not (tmp_path / "torchrun.log").exists(), "nothing may launch for a bad config"


def test_cuda_system_names_map_to_presets(tmp_path: Path) -> None:
    cfg = make_config(tp=1, pp=1, dp=1, out_dir=tmp_path)
    assert system_name(cfg) == "cpu-1thread"
    gpu = make_config(tp=1, pp=1, dp=1, out_dir=tmp_path).__class__(
        **{**cfg.__dict__, "device": "cuda"}
    )
    assert system_name(gpu, "NVIDIA H200") == "dgx-h200"
    assert system_name(gpu, "NVIDIA A100-SXM4-40GB") == "dgx-a100-40gb"
    assert system_name(gpu, "Some GPU 9") == "some-gpu-9"


def _cli() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="clustersim")
    subparsers = parser.add_subparsers(dest="command")
    add_parser(subparsers)
    return parser, subparsers.choices["measure"]


def test_cli_parser_has_example_and_sets_func() -> None:
    parser, measure = _cli()
    argv = [
        "measure",
        "--tp",
        "1",
        "--pp",
        "2",
        "--dp",
        "1",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--out",
        "x",
        "--layers",
        "2",
    ]
    args = parser.parse_args(argv)
    assert callable(args.func) and args.layers == 2 and args.schedule == "1f1b"
    assert "clustersim measure --tp" in (measure.epilog or "")


def test_cli_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser, _ = _cli()
    argv = f"measure --tp 1 --pp 3 --dp 1 --steps 1 --device cpu --out {tmp_path}".split()
    args = parser.parse_args(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.layers=4") and "\n" not in err


def test_a_model_whose_state_cannot_fit_is_refused_before_torchrun(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An absurd size once started torchrun and exited 1 when the workers failed to
    allocate; the parameter state's lower bound (16 B a parameter of the matrices) is
    refused first: exit 2, one line, nothing launched."""
    from calibration.measured.measure_config import state_bytes

    cfg = make_config(tp=1, pp=1, dp=2, out_dir=tmp_path)
    params, need = state_bytes(cfg)
    m = cfg.model
    assert params == m["layers"] * (4 * m["hidden"] ** 2 + 2 * m["hidden"] * m["ffn_hidden"]) \
        + m["vocab"] * m["hidden"]
    assert need == 16 * params * 2  # two replicas on one host
    parser, _ = _cli()
    out = tmp_path / "absurd"
    args = parser.parse_args(f"measure --tp 1 --pp 1 --dp 2 --hidden 65536 --layers 64 "
                             f"--steps 1 --device cpu --out {out}".split())
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "GB of fp32 weights, gradients and AdamW states" in err
    assert "lower --layers, --hidden or --vocab" in err
    assert not out.exists(), "nothing may launch"


def test_measure_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; import calibration.measured.measure as m; "
        "import calibration.measured.measure_trace, calibration.measured.measure_launch; "
        "import calibration.measured.measure_scenario, calibration.measured.gpt_presets; "
        "print(m.scenario_name(m.make_config(tp=1, pp=1, dp=1, out_dir='/tmp/x')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "measured-tp1-pp1-dp1-1f1b"


def test_trace_breakdown_counts_unions_and_comm_names() -> None:
    def ev(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    trace = {
        "traceEvents": [
            ev("aten::mm", 0, 100),
            ev("aten::add", 50, 100),  # overlapping: 150 us
            ev("c10d::allreduce_", 200, 20),
            ev("aten::copy_", 205, 5),  # copy inside: comm
            ev("gloo:all_reduce", 200, 300, tid=2, cat="user_annotation"),  # async, other thread
            ev("aten::broadcast_tensors", 300, 50),  # compute despite the name
            ev("aten::mul", 600, 10),
            ev("Optimizer.step#AdamW.step", 590, 30, cat="user_annotation"),
        ]
    }
    b = breakdown_from_trace(trace, "cpu")
    assert b["compute_s"] == pytest.approx(200e-6)
    assert b["comm_s"] == pytest.approx(300e-6)
    assert b["exposed_comm_s"] == pytest.approx(250e-6)
    assert b["optimizer_s"] == pytest.approx(10e-6)
    assert b["traced_s"] == pytest.approx(620e-6)
    gpu = {
        "traceEvents": [
            ev("ncclDevKernel_ReduceScatter_Sum_f32", 0, 10, cat="kernel"),
            ev("ampere_sgemm", 5, 10, cat="kernel"),
        ]
    }
    g = breakdown_from_trace(gpu, "cuda")
    assert (g["comm_s"], g["compute_s"], g["exposed_comm_s"]) == pytest.approx((1e-5, 1e-5, 5e-6))


def test_step_time_leaves_out_the_harness_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step is timed from the barrier that starts it to the rank's own end: the
    barrier after it (a collective after the optimizer's compute, 3-4 ms of a ~52 ms
    tiny-gpt DP 2 step on the project's VM) is the harness's, not training's."""
    pytest.importorskip("torch")
    from calibration.measured import timing as pw

    clock = [0.0]
    barriers: list[float] = []

    def barrier(device: Any) -> None:  # a slow barrier: 5 s each
        barriers.append(clock[0])
        clock[0] += 5.0

    def step() -> None:  # one step: 1 s of work
        clock[0] += 1.0

    monkeypatch.setattr(pw, "sync", barrier)
    monkeypatch.setattr(pw.time, "perf_counter", lambda: clock[0])
    cfg = argparse.Namespace(warmup=1, steps=3, min_seconds=0.0)
    times, losses = pw.timed_steps(step, cfg, pw.torch.device("cpu"))  # type: ignore[arg-type]
    assert times == [1.0, 1.0, 1.0]
    assert losses is None
    assert len(barriers) == 4  # before each timed step, and one after the last


def test_min_seconds_adds_steps_at_their_pace_the_most_any_rank_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``min_seconds``: the given steps first, then as many more as their median pace
    needs to span it; every rank runs the most any rank asked (they meet in
    collectives), agreed by one all-reduce outside the timed steps."""
    pytest.importorskip("torch")
    from calibration.measured import timing as pw

    assert pw.more_steps([1.0, 1.0, 1.0], 10.0) == 7
    assert pw.more_steps([0.5, 0.4, 0.6], 3.1) == 4  # 1.6 s short at 0.5 s a step
    assert pw.more_steps([2.0, 2.0], 3.0) == 0 == pw.more_steps([1.0], 0.0)
    assert pw.more_steps([], 5.0) == 0

    clock = [0.0]
    asked: list[int] = []

    def step() -> None:
        clock[0] += 1.0

    def all_reduce(t: Any, op: Any) -> None:  # the peer asks for 9 more
        asked.append(int(t.item()))
        t.fill_(max(int(t.item()), 9))

    monkeypatch.setattr(pw, "sync", lambda device: None)
    monkeypatch.setattr(pw.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(pw.dist, "all_reduce", all_reduce)
    cfg = argparse.Namespace(warmup=0, steps=3, min_seconds=10.0)
    times, _ = pw.timed_steps(step, cfg, pw.torch.device("cpu"))  # type: ignore[arg-type]
    assert asked == [7] and times == [1.0] * 12


def test_interval_helpers() -> None:
    assert union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


def test_failure_message_names_rank_code_and_error(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "x_1" / "attempt_0" / "3"
    log.mkdir(parents=True)
    (log / "stderr.log").write_text(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes.\n"
        "Fatal Python error: Aborted\n\nExtension modules: numpy, torch._C (total: 2)\n"
    )
    (tmp_path / "torchrun.log").write_text(
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026\n  host      : h\n"
        "  rank      : 3 (local_rank: 3)\n  exitcode  : -6 (pid: 1)\n"
    )
    msg = failure_message(tmp_path, 1)
    assert msg.startswith("measure: worker rank 3 failed with exit code -6: terminate called")
    assert "Fatal Python error: Aborted" in msg and "Extension modules" not in msg


# --------------------------------------------------------------------------- launches
_RESULTS: dict[str, tuple[dict[str, Any], Path]] = {}


def _measure(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """Run one mode once per session (the loss cross-check reuses the results)."""
    if name not in _RESULTS:
        out = tmp_path_factory.mktemp(name)
        _RESULTS[name] = (run_measure(**MODES[name], **RUN, out_dir=out, timeout_s=180), out)
    return _RESULTS[name]


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@pytest.mark.parametrize("name", list(MODES))
def test_mode_runs_end_to_end(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    mode = MODES[name]
    result, out = _measure(name, tmp_path_factory)
    on_disk = json.loads((out / "measured.json").read_text())
    assert on_disk == result
    assert result["world_size"] == 2 and len(result["step_times_s"]) == RUN["steps"]
    for key in ("step_time_s", "compute_s", "profiled_step_s"):
        assert _positive(result[key]), key
    assert all(_positive(t) for t in result["step_times_s"])
    assert math.isfinite(result["comm_s"]) and result["comm_s"] > 0  # every mode communicates
    assert len(result["peak_memory_bytes"]) == 2 and all(m > 0 for m in result["peak_memory_bytes"])
    assert all(math.isfinite(x) for x in result["losses"])
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    scenario = yaml.safe_load((out / "scenario.yaml").read_text())
    par, model, training = scenario["parallel"], scenario["model"], scenario["training"]
    assert (par["tp"], par["pp"], par["dp"]) == (mode["tp"], mode["pp"], mode["dp"])
    assert par["zero"] == mode.get("zero", 0) == result["zero"]
    assert par["schedule"] == mode.get("schedule", "1f1b")
    assert par["virtual_stages"] == (2 if mode.get("schedule") == "interleaved" else 1)
    assert par["sequence_parallel"] == mode.get("sequence_parallel", False)
    assert {k: model[k] for k in TINY} == TINY == result["model"]
    assert training == {
        "global_batch": 2 * RUN["micro_batches"] * mode["dp"],
        "micro_batch": 2,
        "dtype": "fp32",
    }
    assert scenario["cluster"] == {"system": "cpu-1thread", "nodes": 1, "gpus_per_node": 2}
    if mode["pp"] > 1:
        assert result["tied_weight_max_abs_diff"] == 0.0


def test_min_seconds_times_more_steps_on_every_rank(tmp_path: Path) -> None:
    """A real two-rank run asked for 2 steps and at least a second of them times more
    (a step of this model takes milliseconds), the same count on both ranks (else the
    per-step maximum over ranks could not be formed)."""
    result = run_measure(tp=1, pp=1, dp=2, **{**RUN, "steps": 2}, min_seconds=1.0,
                         out_dir=tmp_path, timeout_s=180)
    assert len(result["step_times_s"]) > 4
    assert len(result["losses"]) == len(result["step_times_s"])


def test_parallel_layouts_compute_the_same_losses(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Same seed and data: TP, PP (any schedule) and SP train the identical model."""
    one_replica = [
        _measure(n, tmp_path_factory)[0]["losses"]
        for n in ("pp2-gpipe", "pp2-1f1b", "tp2", "pp2-interleaved", "tp2-sp")
    ]
    for losses in one_replica[1:]:
        assert losses == pytest.approx(one_replica[0], rel=1e-5)
    ddp, fsdp = (_measure(n, tmp_path_factory)[0]["losses"] for n in ("dp2-ddp", "dp2-fsdp"))
    assert fsdp == pytest.approx(ddp, rel=1e-5)


def test_crashed_worker_is_a_measure_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERSIM_TEST_CRASH_RANK", "1")
    start = time.monotonic()
    with pytest.raises(MeasureError) as info:
        run_measure(tp=1, pp=2, dp=1, **RUN, out_dir=tmp_path, timeout_s=120)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "rank 1" in message and "exit code 1" in message and "injected crash" in message
    assert "\n" not in message
    assert not (tmp_path / "measured.json").exists()


def test_hung_worker_times_out_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLUSTERSIM_TEST_HANG_RANK", "0")
    start = time.monotonic()
    with pytest.raises(MeasureError, match="timed out after 12 s"):
        run_measure(tp=1, pp=1, dp=2, **RUN, out_dir=tmp_path, timeout_s=12)
    assert time.monotonic() - start < 40
    time.sleep(0.5)
    config = str(tmp_path / "run_config.json")
    survivors = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if config in cmdline and int(proc.name) != os.getpid():
                survivors.append(proc.name)
    assert not survivors, f"worker processes left behind: {survivors}"


# --------------------------------------------------------------------------- compare
PROFILE = Path(__file__).resolve().parent.parent / "calibration/profiles/cpu-epyc-1thread.yaml"


@pytest.mark.parametrize("name", list(MODES))
def test_compare_each_mode(name: str, tmp_path_factory: pytest.TempPathFactory,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """`clustersim compare` on every mode's output: finite, positive figures on both
    sides, their relative errors, comparison.json and the two-timeline PNG."""
    from simulator.cli.main import main

    _, out = _measure(name, tmp_path_factory)
    assert main(["compare", str(out), "--profile", str(PROFILE)]) == 0
    assert "step_time_s" in capsys.readouterr().out
    comparison = json.loads((out / "comparison.json").read_text())
    for side in ("measured", "simulated"):
        for key in ("step_time_s", "compute_s", "state_bytes"):
            assert _positive(comparison[side][key]), (side, key)
    err = comparison["relative_error"]["step_time_s"]
    assert math.isfinite(err)
    assert err == pytest.approx(comparison["simulated"]["step_time_s"]
                                / comparison["measured"]["step_time_s"] - 1)
    assert comparison["scenario"]["parallel"]["tp"] == MODES[name]["tp"]
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_rejects_a_directory_without_a_run(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from simulator.cli.main import main

    assert main(["compare", str(tmp_path), "--profile", str(PROFILE)]) == 2
    assert "measured.json" in capsys.readouterr().err

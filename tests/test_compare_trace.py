"""``clustersim compare-trace``: a real job's profiler traces, class by class, beside the
simulation.

GPU traces are written here from the Kineto schema (complete events ``ph: X`` of
category ``kernel``/``gpu_memcpy``/``gpu_user_annotation`` with ``args.stream``,
``args.device``, ``External id`` and, for NCCL kernels, ``Collective name``, ``In msg
nelems`` and ``dtype``; ``distributedInfo`` at the top) with known kernel times, so the
class sums and exposed communication have closed forms. The CPU case reads an excerpt
of the traces ``clustersim measure`` wrote (tiny GPT, DP 2, gloo; tests/data/traces/:
the events of the window that ends with the gradient all-reduce), and one slow test
runs a measured CPU job and compares its traces end to end.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest
from small_scenario import SMALL

from simulator.cli.main import main
from simulator.system.units import COST_CLASSES
from simulator.traces import reader
from simulator.traces.classes import (
    COMPUTE_CLASSES,
    COST_CLASS_TRACE,
    cpu_op_class,
    kernel_class,
)
from simulator.traces.intervals import length, union
from simulator.traces.measured import rank_figures
from simulator.traces.reader import read_trace, read_traces

DATA = Path(__file__).parent / "data" / "traces"
MS = 1000.0  # trace times are microseconds
COMPUTE_STREAM, COMM_STREAM = 7, 20


def kernel(name: str, start_ms: float, end_ms: float, stream: int = COMPUTE_STREAM,
           cat: str = "kernel", **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
            "ts": start_ms * MS, "dur": (end_ms - start_ms) * MS,
            "args": {"stream": stream, "device": 0, "External id": 1, **args}}


def allreduce(start_ms: float, end_ms: float, nelems: int = 1 << 20) -> dict[str, Any]:
    return kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", start_ms, end_ms, COMM_STREAM,
                  **{"Collective name": "allreduce", "In msg nelems": nelems,
                     "Out msg nelems": nelems, "dtype": "BFloat16", "Group size": 2})


def step(n: int, start_ms: float, end_ms: float, cat: str = "gpu_user_annotation"
         ) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": f"ProfilerStep#{n}", "pid": 0, "tid": 1,
            "ts": start_ms * MS, "dur": (end_ms - start_ms) * MS}


def write(path: Path, events: list[dict[str, Any]], rank: int | None = None) -> Path:
    doc: dict[str, Any] = {"schemaVersion": 1, "traceEvents": events}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 8}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def figures_of(path: Path) -> dict[str, float]:
    """A one-file rank's figures per step, times in milliseconds, bytes as they are."""
    return {k: v if k.startswith("bytes_") else v * 1e3
            for k, v in rank_figures([read_trace(path)]).items() if k != "steps"}


# ----------------------------------------------------------------- closed forms (GPU)


def test_gemm_beside_an_overlapping_allreduce_leaves_two_ms_exposed(tmp_path: Path) -> None:
    """GEMM 0-10 ms on the compute stream, AllReduce 5-12 ms on the communication
    stream: 7 ms communicating, 5 of them under the GEMM, 2 exposed; the step is
    0-12 ms (no ProfilerStep: first event to last) and nothing is idle."""
    f = figures_of(write(tmp_path / "rank0.json", [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 10), allreduce(5, 12)], rank=0))
    assert f["gemm"] == pytest.approx(10)
    assert f["all_reduce"] == pytest.approx(7)
    assert (f["compute"], f["comm"]) == (pytest.approx(10), pytest.approx(7))
    assert f["exposed_comm"] == pytest.approx(2)
    assert f["idle"] == pytest.approx(0)
    assert f["step"] == pytest.approx(12)
    assert f["bytes_all_reduce"] == (1 << 20) * 2  # bf16 elements


def test_a_class_on_two_streams_counts_once_and_gaps_are_idle(tmp_path: Path) -> None:
    """GEMMs 0-10 and 5-15 on two streams are 15 ms of GEMM; a norm 20-22, a copy
    22-23 and a memset 23-24: compute 17, memcpy 2, idle the gap 15-20."""
    f = figures_of(write(tmp_path / "rank0.json", [
        kernel("ampere_bf16_s16816gemm_bf16_128x128", 0, 10),
        kernel("cutlass_80_tensorop_gemm", 5, 15, stream=8),
        kernel("void at::native::vectorized_layer_norm_kernel", 20, 22),
        kernel("Memcpy DtoD (Device -> Device)", 22, 23, cat="gpu_memcpy"),
        kernel("Memset (Device)", 23, 24, cat="Memset")], rank=0))  # older Kineto's
    assert f["gemm"] == pytest.approx(15)
    assert f["norm"] == pytest.approx(2)
    assert f["memcpy"] == pytest.approx(2)
    assert f["compute"] == pytest.approx(17)
    assert f["idle"] == pytest.approx(5)
    assert f["step"] == pytest.approx(24)


def test_figures_are_per_profiler_step_and_clipped_to_the_steps(tmp_path: Path) -> None:
    """Two device-side steps of 20 ms, each with a 12 ms GEMM and then a 6 ms AllReduce
    (all exposed) and 2 ms idle; a kernel after the last step does not count."""
    events = []
    for n, t0 in enumerate((0.0, 20.0)):
        events += [step(n, t0, t0 + 20), kernel("nvjet_tst_128x256_64x4", t0, t0 + 12),
                   allreduce(t0 + 12, t0 + 18)]
    events.append(kernel("flash_fwd_kernel", 50, 60))
    f = figures_of(write(tmp_path / "rank0.json", events, rank=0))
    assert f["step"] == pytest.approx(20)
    assert f["gemm"] == pytest.approx(12)
    assert f["attention"] == pytest.approx(0)
    assert f["exposed_comm"] == pytest.approx(6)
    assert f["idle"] == pytest.approx(2)


@pytest.mark.parametrize(("name", "collective", "cls"), [
    ("flash_fwd_kernel", None, "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", None, "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1", None, "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", None, "gemm"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_NNT", None, "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", None, "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel", None, "norm"),
    ("triton_per_fused_rms_norm_0", None, "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
     None, "elementwise"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward", None, "elementwise"),
    ("ncclDevKernel_AllGather_RING_LL", None, "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", None, "reduce_scatter"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", None, "send_recv"),
    ("ncclDevKernel_SendRecv", "all_to_all", "all_to_all"),  # only the argument tells
    ("ncclDevKernel_Broadcast_RING_LL", None, "other_comm"),
    ("Memcpy HtoD (Pinned -> Device)", None, "memcpy"),
])
def test_kernel_classes(name: str, collective: str | None, cls: str) -> None:
    assert kernel_class(name, collective) == cls


@pytest.mark.parametrize(("name", "cls"), [
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::linear", "gemm"),
    ("AddmmBackward0", "gemm"), ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                 "attention"),
    ("aten::native_layer_norm_backward", "norm"), ("NativeLayerNormBackward0", "norm"),
    ("c10d::allreduce_", "all_reduce"), ("gloo:all_reduce", "all_reduce"),
    ("_c10d_functional::all_gather_into_tensor", "all_gather"), ("gloo:send", "send_recv"),
    ("_c10d_functional::wait_tensor", "other_comm"),
    ("aten::broadcast_tensors", None), ("aten::t", None), ("aten::add_", None),
])
def test_cpu_op_classes(name: str, cls: str | None) -> None:
    assert cpu_op_class(name) == cls


def test_every_cost_class_maps_to_a_compute_class() -> None:
    assert set(COST_CLASS_TRACE) == set(COST_CLASSES)
    assert set(COST_CLASS_TRACE.values()) <= set(COMPUTE_CLASSES)
    assert COST_CLASS_TRACE["gemm_wgrad"] == "gemm"
    assert COST_CLASS_TRACE["attention_bwd"] == "attention"


# ----------------------------------------------------------------- closed forms (CPU)


def cpu_op(name: str, start_ms: float, end_ms: float, tid: int = 1,
           cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid,
            "ts": start_ms * MS, "dur": (end_ms - start_ms) * MS}


def test_cpu_time_goes_to_the_innermost_op_that_names_a_class(tmp_path: Path) -> None:
    """aten::linear 0-10 holds aten::t 0-1 (GEMM time: its parent's) and aten::addmm
    2-8; aten::add 10-12 is elementwise; c10d::allreduce_ 12-13 holds a copy (its
    time); gloo's all-reduce runs 12-20 on its own thread, 8 ms of which nothing
    computes; aten::layer_norm 14-16 on the main thread overlaps it."""
    f = figures_of(write(tmp_path / "trace_rank3.json", [
        cpu_op("aten::linear", 0, 10), cpu_op("aten::t", 0, 1), cpu_op("aten::addmm", 2, 8),
        cpu_op("aten::add", 10, 12), cpu_op("c10d::allreduce_", 12, 13),
        cpu_op("aten::copy_", 12, 12.5), cpu_op("aten::layer_norm", 14, 16),
        cpu_op("gloo:all_reduce", 12, 20, tid=2, cat="user_annotation")]))
    assert f["gemm"] == pytest.approx(10)
    assert f["elementwise"] == pytest.approx(2)
    assert f["norm"] == pytest.approx(2)
    assert f["all_reduce"] == pytest.approx(8)
    assert f["compute"] == pytest.approx(14)
    assert f["exposed_comm"] == pytest.approx(6)
    assert f["idle"] == pytest.approx(0)
    assert f["step"] == pytest.approx(20)


def test_cpu_profiler_steps_divide_the_figures(tmp_path: Path) -> None:
    """Two CPU ProfilerStep annotations of 10 ms, each with a 5 ms aten::mm; an op
    before the first step does not count."""
    f = figures_of(write(tmp_path / "rank0.json", [
        cpu_op("aten::add", -4, -1), step(1, 0, 10, cat="user_annotation"),
        cpu_op("aten::mm", 0, 5), step(2, 10, 20, cat="user_annotation"),
        cpu_op("aten::mm", 12, 17)]))
    assert (f["step"], f["gemm"], f["elementwise"]) == pytest.approx((10, 5, 0))
    assert f["idle"] == pytest.approx(5)


# ----------------------------------------------------------------- files and ranks


def test_rank_from_distributed_info_else_the_name_and_files_add_steps(tmp_path: Path) -> None:
    """A rank's two files (one gzipped) add their steps; distributedInfo wins over a
    name that says otherwise."""
    write(tmp_path / "a" / "host_1.pt.trace.json", [step(0, 0, 10), kernel("gemm", 0, 4)],
          rank=1)
    two = json.dumps({"traceEvents": [step(1, 0, 10), kernel("gemm", 0, 8)]}).encode()
    (tmp_path / "a" / "trace_rank1.json.gz").write_bytes(gzip.compress(two))
    write(tmp_path / "a" / "rank0.json", [kernel("gemm", 0, 5)], rank=2)
    traces = read_traces(tmp_path / "a")
    assert sorted(traces) == [1, 2]
    f = rank_figures(traces[1])
    assert f["steps"] == 2
    assert f["gemm"] * 1e3 == pytest.approx(6)  # (4 + 8) / 2 steps
    assert f["step"] * 1e3 == pytest.approx(10)


def test_a_measured_run_directory_means_its_traces(tmp_path: Path) -> None:
    """`clustersim measure --out RUN` writes measured.json beside RUN/traces/: RUN is
    read as its traces, not its metadata."""
    run = tmp_path / "run"
    write(run / "traces" / "trace_rank0.json", [step(0, 0, 10), kernel("gemm", 0, 4)])
    (run / "measured.json").write_text(json.dumps({"step_time_s": 0.01}))
    traces = read_traces(run)
    assert list(traces) == [0]
    assert rank_figures(traces[0])["gemm"] * 1e3 == pytest.approx(4)


def _small_job(directory: Path, slow: int | None = None) -> None:
    """Eight ranks of the small scenario (TP 2, PP 2, DP 2), one step each: a GEMM,
    attention, a norm, a TP AllReduce after them; ``slow`` takes twice as long to
    compute and so waits less."""
    for rank in range(8):
        k = 2.0 if rank == slow else 1.0
        write(directory / f"rank{rank}.json", [
            step(0, 0, 4.0), kernel("sm90_xmma_gemm", 0, 1.0 * k),
            kernel("flash_fwd_kernel", 1.0 * k, 1.5 * k), kernel("rms_norm_kernel", 1.5 * k,
                                                                 1.6 * k),
            allreduce(1.6 * k, 3.6)], rank=rank)


def test_multi_rank_job_end_to_end_names_the_rank_that_differs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    _small_job(tmp_path / "traces", slow=5)
    out = tmp_path / "out"
    assert main(["compare-trace", str(tmp_path / "traces"), str(scenario),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ranks farthest from the median measured rank (off_peers): 5 (" in printed
    data = json.loads((out / "comparison.json").read_text())
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert sorted(ranks) == list(range(8))
    assert max(ranks, key=lambda r: ranks[r]["off_peers"]) == 5
    assert data["differing_ranks"]["off_peers"][0] == 5
    # rank 5 computes 3.2 ms of 4 (the others 1.6) and waits 0.4 in its AllReduce
    assert ranks[5]["compute_measured"] == pytest.approx(3.2e-3)
    assert ranks[5]["exposed_comm_measured"] == pytest.approx(0.4e-3)
    assert ranks[0]["exposed_comm_measured"] == pytest.approx(2.0e-3)
    classes = {c["figure"]: c for c in data["classes"]}
    assert classes["gemm"]["measured_max"] == pytest.approx(2e-3)
    assert classes["gemm"]["measured"] == pytest.approx((7 * 1e-3 + 2e-3) / 8)
    # the simulated side: its step, and its compute classes add up to its compute
    sim_step = data["simulated_results"]["step_time_s"]
    assert classes["step"]["simulated"] == pytest.approx(sim_step)
    assert sum(classes[c]["simulated"] for c in COMPUTE_CLASSES) == \
        pytest.approx(classes["compute"]["simulated"])
    assert classes["exposed_comm"]["simulated"] <= classes["comm"]["simulated"] + 1e-12
    for name in ("classes.csv", "ranks.csv", "compare-trace.md"):
        assert (out / name).stat().st_size > 0
    assert (out / "classes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 5 |" in (out / "compare-trace.md").read_text()


def test_checked_in_cpu_trace_of_a_measured_run(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The excerpt of a measured DP-2 CPU run: the all-reduce is the union of c10d's
    enqueue and gloo's work; the step splits into compute, exposed communication and
    idle; the compute classes split compute; and the command runs on it."""
    for path in sorted((DATA / "cpu-dp2").glob("*.json")):
        events = json.loads(path.read_text())["traceEvents"]
        comm = union((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e["name"] in ("c10d::allreduce_", "gloo:all_reduce"))
        f = rank_figures([read_trace(path)])
        assert f["all_reduce"] == pytest.approx(length(comm) * 1e-6)
        assert f["compute"] + f["exposed_comm"] + f["idle"] == pytest.approx(f["step"])
        assert sum(f[c] for c in COMPUTE_CLASSES) == pytest.approx(f["compute"])
        assert f["compute"] > 0 and f["exposed_comm"] > 0
    out = tmp_path / "out"
    assert main(["compare-trace", str(DATA / "cpu-dp2"), str(DATA / "cpu-dp2.yaml"),
                 "--out", str(out), "--no-plots"]) == 0
    assert "all_reduce" in capsys.readouterr().out
    assert not (out / "classes.png").exists()


# ----------------------------------------------------------------- bad input


def _bad_cases(tmp: Path) -> list[tuple[Path, str]]:
    good = [step(0, 0, 10), kernel("gemm", 0, 5)]
    cases: list[tuple[Path, str]] = []

    def case(name: str, text: str | bytes, expect: str) -> None:
        d = tmp / name
        d.mkdir(parents=True)
        p = d / "rank0.json" if not name.startswith("gz") else d / "rank0.json.gz"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        cases.append((d, expect))

    case("not-json", "{traceEvents: [", "is not valid JSON")
    case("no-events", json.dumps({"schemaVersion": 1}), "traceEvents is missing")
    case("event-not-object", json.dumps({"traceEvents": [3]}), "traceEvents[0] is int")
    case("negative-dur", json.dumps({"traceEvents": [{**good[1], "dur": -1}]}),
         "traceEvents[0].dur is -1")
    case("string-ts", json.dumps({"traceEvents": [good[0], {**good[1], "ts": "5"}]}),
         "traceEvents[1].ts is '5'")
    case("nan", '{"traceEvents": [{"ph": "X", "ts": NaN, "dur": 1}]}', "NaN")
    case("deep", '{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}", "recursion")
    case("huge-int", '{"traceEvents": [{"ph": "X", "ts": 1%s, "dur": 1}]}' % ("0" * 400),
         "an integer of 401 digits")  # the bounded JSON reader refuses it
    case("overflow", json.dumps({"traceEvents": [{**good[1], "ts": 1.7e308, "dur": 1.7e308}]}),
         "traceEvents[0] ends past the largest time")
    case("args-list", json.dumps({"traceEvents": [{**good[1], "args": [1]}]}),
         "traceEvents[0].args")
    case("bad-rank", json.dumps({"traceEvents": good, "distributedInfo": {"rank": -1}}),
         "distributedInfo.rank is -1")
    case("empty", json.dumps({"traceEvents": []}), "no complete event")
    case("gz-cut", gzip.compress(json.dumps({"traceEvents": good}).encode())[:20], "gzip")
    d = tmp / "no-rank"
    write(d / "host_123.pt.trace.json", good)
    cases.append((d, "no rank<N>"))
    d = tmp / "beyond-world"
    write(d / "trace_rank8.json", good)
    cases.append((d, "rank 8 is not in the scenario's 8 ranks"))
    (tmp / "no-traces").mkdir(parents=True)
    cases.append((tmp / "no-traces", "holds no *.json"))
    return cases


def test_malformed_traces_are_one_line_errors_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    for directory, expect in _bad_cases(tmp_path / "cases"):
        assert main(["compare-trace", str(directory), str(scenario),
                     "--out", str(tmp_path / "out")]) == 2, directory
        lines = capsys.readouterr().err.strip().splitlines()
        err = [line for line in lines if not line.startswith(("reading ", "warning: "))]
        assert len(err) == 1 and expect in err[0], (directory.name, lines)
        assert str(directory) in err[0], (directory.name, err)
        assert "Traceback" not in err[0]
    assert not (tmp_path / "out" / "comparison.json").exists()


def test_a_gzip_bomb_stops_at_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "TRACE_LIMIT_BYTES", 1 << 16)
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(b"[" + b" " * (1 << 20) + b"]"))
    with pytest.raises(reader.UserError, match="decompresses to more than 65,536 bytes"):
        read_trace(path)


def test_a_device_file_is_refused_unread(tmp_path: Path) -> None:
    with pytest.raises(reader.UserError, match="not a regular file"):
        read_trace(Path("/dev/zero"))


# ----------------------------------------------------------------- a measured run


@pytest.mark.slow
def test_a_measured_cpu_job_end_to_end(tmp_path: Path) -> None:
    """``clustersim measure`` (tiny GPT, DP 2, CPU) writes every rank's traces;
    compare-trace reads them all and sets them beside the measured scenario."""
    pytest.importorskip("torch")
    from calibration.measured.measure import run_measure

    tiny = {"layers": 2, "hidden": 32, "heads": 2, "ffn_hidden": 64, "vocab": 64,
            "seq_len": 16}
    run = tmp_path / "run"
    measured = run_measure(tp=1, pp=1, dp=2, micro_batches=2, model=tiny, steps=2,
                           warmup=1, device="cpu", out_dir=run, timeout_s=180)
    out = tmp_path / "out"
    assert main(["compare-trace", str(run / "traces"), str(run / "scenario.yaml"),
                 "--out", str(out)]) == 0
    data = json.loads((out / "comparison.json").read_text())
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert sorted(ranks) == [0, 1]
    for r, per_rank in zip((0, 1), measured["per_rank"], strict=True):
        # the same trace: the same union of gloo's all-reduce and c10d's enqueue as the
        # measured run's own parser (calibration.measured.measure_trace)
        assert ranks[r]["comm_measured"] == pytest.approx(per_rank["comm_s"], rel=1e-9)
        assert 0 < ranks[r]["step_measured"] <= per_rank["traced_s"]
    classes = {c["figure"]: c for c in data["classes"]}
    for c in ("gemm", "attention", "norm", "elementwise", "all_reduce"):
        assert classes[c]["measured"] > 0 and math.isfinite(classes[c]["simulated"]), c
    assert (out / "classes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------- the simulated side


def test_simulated_spans_cut_like_a_trace() -> None:
    """A hand-made span table: forward 0-10, a TP all-reduce 10-12 on the compute
    stream, a DP all-reduce 5-15 on its own, the optimizer 15-16, an offload copy
    16-17 and the host's optimizer step 17-19 (no device time), in a 20-step: compute
    11 (10 split by the shares, the optimizer elementwise), all-reduce 10 of which 5
    exposed, memcpy 1, idle 3."""
    import pandas as pd

    from simulator.traces.simulated import span_figures

    spans = pd.DataFrame([
        {"rank": 0, "stage": 0, "kind": "forward", "op": "F", "start": 0.0, "end": 10.0,
         "bytes": 0.0},
        {"rank": 0, "stage": 0, "kind": "tp", "op": "tp.all_reduce", "start": 10.0,
         "end": 12.0, "bytes": 100.0},
        {"rank": 0, "stage": 0, "kind": "dp", "op": "dp.all_reduce", "start": 5.0,
         "end": 15.0, "bytes": 50.0},
        {"rank": 0, "stage": 0, "kind": "optimizer", "op": "optimizer", "start": 15.0,
         "end": 16.0, "bytes": 0.0},
        {"rank": 0, "stage": 0, "kind": "offload", "op": "offload.d2h", "start": 16.0,
         "end": 17.0, "bytes": 8.0},
        {"rank": 0, "stage": 0, "kind": "optimizer", "op": "optimizer", "start": 17.0,
         "end": 19.0, "bytes": 0.0, "stream": "host"}])
    spans["stream"] = spans["stream"].fillna("compute")
    shares = {"gemm": 0.5, "attention": 0.2, "norm": 0.1, "elementwise": 0.2}
    f = span_figures(spans, 20.0, shares)
    assert (f["gemm"], f["attention"], f["norm"]) == pytest.approx((5, 2, 1))
    assert f["elementwise"] == pytest.approx(3)
    assert f["compute"] == pytest.approx(11)
    assert (f["all_reduce"], f["comm"], f["exposed_comm"]) == pytest.approx((10, 10, 5))
    assert f["memcpy"] == pytest.approx(1)
    assert f["idle"] == pytest.approx(3)
    assert f["bytes_all_reduce"] == 150.0


@pytest.mark.parametrize(("fidelity", "expected"), [
    ("folded", {0: 0, 1: 0, 3: 0, 4: 4, 5: 4, 7: 4}),
    ("full", {0: 0, 1: 1, 3: 3, 4: 4, 5: 5, 7: 7})])
def test_a_measured_rank_stands_beside_its_stage_when_folded(
        tmp_path: Path, fidelity: str, expected: dict[int, int]) -> None:
    from simulator.api import simulate_scenario
    from simulator.spec.load import load_scenario
    from simulator.traces.simulated import class_shares, simulated_figures

    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    s = load_scenario(path, [])
    results, spans = simulate_scenario(s, "engine", fidelity)
    assert spans is not None
    sim = simulated_figures(s, results, spans, list(expected))
    assert {r: int(f["sim_rank"]) for r, f in sim.items()} == expected
    for stage in (0, 1):
        shares = class_shares(s, stage)
        assert sum(shares.values()) == pytest.approx(1)
        assert min(shares.values()) >= 0 and shares["gemm"] > 0


# ----------------------------------------------------------------- properties

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_KERNELS = ("sm90_xmma_gemm", "flash_fwd_kernel", "layer_norm_kernel", "elementwise_kernel",
            "ncclDevKernel_AllReduce", "ncclDevKernel_AllGather", "Memcpy DtoD")
_span = st.tuples(st.sampled_from(_KERNELS), st.integers(0, 200), st.integers(0, 50),
                  st.sampled_from((7, 8, 20)))


@settings(max_examples=60, deadline=None)
@given(st.lists(_span, min_size=1, max_size=25))
def test_overlap_figures_partition_the_step(tmp_path_factory: pytest.TempPathFactory,
                                            spans: list[tuple[str, int, int, int]]) -> None:
    """Any kernels on any streams: exposed communication is communication outside
    compute; compute, exposed communication, memcpy outside both and idle add up to the
    step; a class is at most the union of its kind; the union is at most their sum."""
    events = [kernel(n, a, a + d, s, cat="gpu_memcpy" if n.startswith("Memcpy") else "kernel")
              for n, a, d, s in spans]
    path = write(tmp_path_factory.mktemp("p") / "rank0.json", events, rank=0)
    f = figures_of(path)
    busy = union((e["ts"] / MS, (e["ts"] + e["dur"]) / MS) for e in events)
    compute = union((e["ts"] / MS, (e["ts"] + e["dur"]) / MS) for e in events
                    if not e["name"].startswith(("nccl", "Memcpy")))
    # no ProfilerStep: one step from the first event to the last, empty ones too
    assert f["step"] == pytest.approx(max(a + d for _, a, d, _ in spans)
                                      - min(a for _, a, _, _ in spans))
    assert f["idle"] == pytest.approx(f["step"] - length(busy), abs=1e-9)
    assert f["compute"] == pytest.approx(length(compute), abs=1e-9)
    assert 0 <= f["exposed_comm"] <= f["comm"] + 1e-9
    assert f["compute"] + f["exposed_comm"] <= f["step"] - f["idle"] + 1e-9
    assert max(f[c] for c in COMPUTE_CLASSES) <= f["compute"] + 1e-9
    assert f["compute"] <= sum(f[c] for c in COMPUTE_CLASSES) + 1e-9


_value = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(-1e3, 1e6),
                   st.sampled_from((10**400, 1.7e308)),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2))
_event = st.dictionaries(
    st.sampled_from(("ph", "cat", "name", "ts", "dur", "args", "pid", "tid")),
    st.one_of(_value, st.sampled_from(("X", "kernel", "cpu_op", "user_annotation",
                                       "ProfilerStep#1", "ncclDevKernel_AllReduce")),
              st.dictionaries(st.sampled_from(("stream", "Collective name", "dtype",
                                               "In msg nelems")), _value, max_size=3)),
    max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.lists(_event, max_size=6),
                 st.dictionaries(st.sampled_from(("traceEvents", "distributedInfo")),
                                 st.one_of(_value, st.lists(_event, max_size=6),
                                           st.dictionaries(st.just("rank"), _value)),
                                 max_size=2)))
def test_any_json_is_figures_or_a_one_line_error(tmp_path_factory: pytest.TempPathFactory,
                                                 doc: Any) -> None:
    """Whatever JSON a trace file holds, reading and cutting it gives finite figures or
    a UserError of one line naming the file, never another exception."""
    path = tmp_path_factory.mktemp("j") / "rank0.json"
    path.write_text(json.dumps(doc))
    try:
        f = rank_figures([read_trace(path)])
    except reader.UserError as exc:
        lines = str(exc).splitlines()
        assert len(lines) == 1 and str(path) in lines[0]
    else:
        assert all(math.isfinite(v) and v >= -1e-9 for v in f.values())

"""What a measured run on a GPU differs in from one on a CPU, checked without a GPU:
the compute figure ``compare`` takes from the profiled step, the optimizer the
scenario's stack runs, and the kernels the host-cost measurement divides by."""

from __future__ import annotations

from typing import Any

import pytest

from calibration.measured.compare import measured_figures
from calibration.measured.measure_config import MeasureConfig
from calibration.measured.measure_scenario import scenario_dict, stack_for


def _measured(device: str) -> dict[str, Any]:
    # a step of 100 ms whose profiled step took 200 ms, 60 ms of it compute
    rank = {"compute_s": 0.060, "optimizer_s": 0.010, "profiled_step_s": 0.200}
    return {"step_time_s": 0.100, "device": device, "per_rank": [rank], "state_bytes": [1.0]}


def test_cpu_compute_is_rescaled_by_the_profilers_stretch() -> None:
    """On a CPU the profiler stretches the aten ops that are the compute: halve them."""
    fig = measured_figures(_measured("cpu"))
    assert fig["compute_s"] == pytest.approx(0.030)
    assert fig["non_compute_s"] == pytest.approx(0.100 - 0.030 - 0.005)


def test_gpu_kernel_time_is_taken_as_measured() -> None:
    """On a GPU compute is kernel time on the device, which the profiler's host overhead
    does not stretch (on the H200, gpt-0.9b: 120 ms of kernels in a 165 ms step whose
    profiled run took 299 ms; rescaled, the kernels read 66 ms)."""
    fig = measured_figures(_measured("cuda"))
    assert fig["compute_s"] == pytest.approx(0.060)
    assert fig["non_compute_s"] == pytest.approx(0.100 - 0.060 - 0.010)
    assert fig["idle_fraction"] == pytest.approx(0.30)


def _cfg(device: str) -> MeasureConfig:
    return MeasureConfig(tp=1, pp=1, dp=1, schedule="1f1b", zero=0, micro_batches=4,
                         micro_batch_size=2, model={"layers": 2, "hidden": 64, "heads": 4,
                                                    "ffn_hidden": 256, "vocab": 128,
                                                    "seq_len": 32},
                         steps=1, warmup=0, device=device, threads=1, out_dir="unused")


def test_a_cuda_run_simulates_the_foreach_optimizer_and_autocast_it_runs() -> None:
    """torch.optim.AdamW with neither foreach nor fused runs foreach on CUDA tensors and
    the for-loop on CPU ones (torch/optim/optimizer.py _default_to_fused_or_foreach);
    the CUDA runs step under bf16 autocast over fp32 parameters."""
    from simulator.spec.load import scenario_from_dict

    assert stack_for("cpu") == "pytorch-eager"
    cpu = scenario_from_dict(scenario_dict(_cfg("cpu")))
    gpu = scenario_from_dict(scenario_dict(_cfg("cuda"), device_name="NVIDIA H200"))
    assert cpu.stack.optimizer == "per_tensor" and gpu.stack.optimizer == "foreach"
    assert not cpu.stack.autocast and gpu.stack.autocast
    assert gpu.stack.name == "pytorch-eager" and gpu.cluster.system == "dgx-h200"
    # everything else is the preset's
    assert gpu.stack.model_dump(exclude={"optimizer", "autocast", "preset"}) == \
        cpu.stack.model_dump(exclude={"optimizer", "autocast", "preset"})


def test_host_cost_counts_the_host_work_of_the_devices_optimizer() -> None:
    """The degenerate step's optimizer host units as the simulator counts them: 10 kernels
    per tensor for the for-loop (CPU); foreach (CUDA) launches 7 kernels per chunk (one
    chunk here: 16 tensors a layer + 4 is under 110) but does its host work per tensor of
    each of its 7 ops. A CUDA micro-batch adds autocast's casts: per layer 4 forward
    (q, k, v, up inputs), their 4 gradients back, 12 weight and bias gradients and the 2
    residual adds' gradients for their bf16 branches, and 2 each way around the logits."""
    from calibration.measured.host_counts import HOST_GPT, step_counts
    from simulator.model.inventory.optimizer import optimizer_op
    from simulator.spec.stack import StackSpec

    cpu, gpu = step_counts(device="cpu"), step_counts(device="cuda")
    tensors = 16 * HOST_GPT["layers"] + 4
    assert cpu.optimizer == 10 * tensors
    assert gpu.optimizer == 7 * tensors
    casts = HOST_GPT["layers"] * (4 + 4 + 12 + 2) + 2 + 2
    assert (gpu.first - cpu.first, gpu.later - cpu.later) == (casts, casts)
    foreach = StackSpec.model_validate(stack_for("cuda"))
    op = optimizer_op(1e5, tensors, foreach, "fp32")
    assert (op.kernels, op.host_ops) == (7, 7 * tensors)
    # a 0.9B model: 43 chunks of 2.1e7 parameters launch 301 kernels; the host still
    # works per tensor (260 of them)
    big = optimizer_op(0.9e9, 260, foreach, "bf16")
    assert (big.kernels, big.host_ops) == (7 * 43, 7 * 260)


def test_gpu_host_cost_is_a_floor_beside_the_kernels() -> None:
    """On a GPU profile (host not serial) the measured host cost replaces the stack's
    figure and bounds an op from below: max(device, kernels × host), never a sum."""
    from simulator.model.inventory.ops import Op
    from simulator.system.costs import CostModel
    from simulator.system.profiles import load_system

    hw = load_system("dgx-h200")
    gpu = hw.gpu.model_copy(update={"host_overhead_us": 30.0})
    hw = hw.model_copy(update={"gpu": gpu})
    tiny = Op("tiny", "memory", 0.0, 1e3, 0.0, "elementwise", 2)
    big = Op("big", "memory", 0.0, 1e10, 0.0, "elementwise", 2)
    cost = CostModel(hw, "bf16", host_us=10.0)
    assert not gpu.host_serial
    assert cost.op_time(tiny) == pytest.approx(2 * 30e-6)
    device = CostModel(hw, "bf16").op_time(big)
    assert device > 2 * 30e-6 and cost.op_time(big) == pytest.approx(device)


def _host_lead_cost() -> Any:
    """The H200 preset at full HBM bandwidth for every size (a flat memory curve), no
    device overhead, 10 µs of host a kernel: a memory op's device time is bytes / HBM."""
    from simulator.system.costs import CostModel
    from simulator.system.curves import EfficiencyCurve
    from simulator.system.profiles import load_system

    hw = load_system("dgx-h200")
    gpu = hw.gpu.model_copy(update={"host_overhead_us": 10.0, "kernel_overhead_us": 0.0,
                                    "memory_efficiency": EfficiencyCurve(points=((1.0, 1.0),))})
    return CostModel(hw.model_copy(update={"gpu": gpu}), "bf16", host_us=10.0)


def _op(device_us: float) -> Any:
    """A one-kernel memory op whose device time is ``device_us`` on that flat curve."""
    from simulator.model.inventory.ops import Op

    nbytes = device_us * 1e-6 * _host_lead_cost().hbm
    return Op("x", "memory", 0.0, nbytes, 0.0, "elementwise", 1)


def test_the_host_banks_its_issue_time_behind_a_long_kernel() -> None:
    """A 100 us kernel then five 1 us ones, each 10 us of host: the host issues the five
    while the long one runs, so the run ends at 100 + 5 x 1 us, not at the per-op
    max's 100 + 5 x 10 us; a run of short kernels alone waits for the host (5 x 10 us)."""
    cost = _host_lead_cost()
    long, short = _op(100.0), _op(1.0)
    assert cost.op_time(long) == pytest.approx(100e-6, rel=1e-3)
    assert cost.op_time(short) == pytest.approx(10e-6)  # one op alone: max(device, host)
    assert cost.ops_time([long, *[short] * 5]) == pytest.approx(105e-6, rel=1e-3)
    assert cost.ops_time([short] * 5) == pytest.approx(50e-6)
    # short ones first: nothing to bank behind, the long kernel starts after them
    assert cost.ops_time([*[short] * 5, long]) == pytest.approx(150e-6, rel=1e-3)


@pytest.mark.parametrize("seed", range(5))
def test_host_lead_lies_between_its_bounds(seed: int) -> None:
    """Any sequence: at least the host's total and the device's total, at most the sum
    of per-op maxima (no lead at all)."""
    import random

    rng = random.Random(seed)
    cost = _host_lead_cost()
    ops = [_op(rng.choice([0.5, 2.0, 8.0, 30.0, 120.0])) for _ in range(12)]
    parts = [cost.op_parts(op) for op in ops]
    device = sum(max(c, m) + o for c, m, o, _ in parts)
    host = sum(h for *_, h in parts)
    t = cost.ops_time(ops)
    assert max(device, host) - 1e-12 <= t <= sum(cost.op_time(op) for op in ops) + 1e-12


class _FakeCuda:
    """Just enough of torch.cuda to see what the timing loop asks of the device."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def Event(self, enable_timing: bool = False) -> Any:
        log = self.log

        class _Event:
            def record(self) -> None:
                log.append("record")

            def synchronize(self) -> None:
                log.append("sync")

            def elapsed_time(self, other: Any) -> float:
                return 1.0

        return _Event()

    def _sleep(self, cycles: int) -> None:
        self.log.append(("spin", cycles))

    def get_device_properties(self, index: int) -> Any:
        return type("Props", (), {"clock_rate": 1_980_000})()  # kHz, an H200's SM clock

    def synchronize(self, index: int = 0) -> None:
        self.log.append("sync")


def test_gpu_batches_are_queued_behind_a_spin_longer_than_their_issue() -> None:
    """Each timed batch on CUDA starts behind a spin kernel that outlasts the host's issue
    of the batch, so the events bracket device time alone (the per-kernel overhead is
    then the device's launch gap, not the benchmark loop's Python)."""
    import types

    from calibration.microbench.bench_timing import MAX_QUEUED, Device, time_calls

    log: list[Any] = []
    device = Device("cuda")
    device._torch = types.SimpleNamespace(cuda=_FakeCuda(log))
    calls: list[int] = []
    # a batch of 10 s of no-op calls: capped at the launch queue unless one no-op took
    # 20 ms (the default 2 ms batch wanted a no-op under 3.9 us, which a loaded CI
    # machine's scheduler missed once: 369 calls a rep)
    t = time_calls(device, calls.append, 4, target_s=1e-3, min_reps=3,
                   max_reps=3, min_batch_s=10.0)
    assert t.calls_per_rep == MAX_QUEUED
    spins = [e for e in log if isinstance(e, tuple)]
    assert len(spins) == 3
    records = [i for i, e in enumerate(log) if e == "record"]
    for spin in spins:  # each batch's start event right behind its spin
        assert log[log.index(spin) + 1] == "record"
        # at least the batch's 200 µs floor, at 1.98 GHz
        assert spin[1] >= int(2e-4 * 1.98e9)
    assert len(records) == 6


def _layer_ops(pass_: str, autocast: bool, dtype: str = "bf16") -> list[Any]:
    from simulator.model import transformer as mdl
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.stack import StackSpec

    spec = ModelSpec.model_validate({"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4,
                                     "ffn_hidden": 256, "vocab": 128, "seq_len": 32,
                                     "activation": "gelu", "norm": "layernorm", "bias": True,
                                     "tied_embeddings": True, "position": "learned"})
    stack = StackSpec.model_validate({"preset": "pytorch-eager", "autocast": autocast})
    return list(mdl.layer_ops(spec, 2, 1, False, dtype, pass_, 0, stack))  # type: ignore[arg-type]


def _amp_layer(pass_: str, autocast: bool, dtype: str = "bf16") -> dict[str, Any]:
    return {op.name: op for op in _layer_ops(pass_, autocast, dtype)}


def test_autocast_casts_each_linears_input_and_keeps_the_stream_in_fp32() -> None:
    """bf16 autocast over fp32 parameters (our CUDA runs): q, k, v and the MLP's up each
    cast the norm's fp32 output (4 + 2 bytes an element, one copy each: the H200 trace's
    4 a layer a micro-batch), the backward casts each input gradient back, the norms and
    the residual adds run on the fp32 stream, and every weight and bias gradient is cast
    back to its fp32 parameter (12 a layer: the trace's ToCopyBackward0)."""
    T, h, ffn = 2 * 32, 64, 256
    plain, amp = _amp_layer("fwd", False), _amp_layer("fwd", True)
    assert "amp_cast_qkv" not in plain
    assert (amp["amp_cast_qkv"].kernels, amp["amp_cast_qkv"].bytes) == (3, 3 * T * h * 6)
    assert (amp["amp_cast_up"].kernels, amp["amp_cast_up"].bytes) == (1, T * h * 6)
    assert amp["ln1"].bytes == 2 * plain["ln1"].bytes  # fp32 in and out
    assert amp["ln1"].saved == 4 * T * h  # the fp32 input it keeps
    assert amp["residual"].bytes == (4 + 2 + 4) * T * h  # fp32 stream + bf16 branch
    bwd = _amp_layer("bwd_input", True)
    assert bwd["amp_cast_qkv"].bytes == amp["amp_cast_qkv"].bytes
    # the residual add's backward casts the fp32 gradient for the bf16 branch (the
    # trace's AddBackward0 copies, 2 a layer a micro-batch); without autocast, nothing
    assert bwd["amp_cast_residual"].bytes == T * h * 6
    assert sum(op.name == "amp_cast_residual" for op in _layer_ops("bwd_input", True)) == 2
    assert not any(op.name.startswith("amp_") for op in _layer_ops("bwd_input", False))
    names = list(bwd)  # the backward's order: GEMM, its input gradients cast, their sum
    assert names.index("qkv") < names.index("amp_cast_qkv") < names.index("qkv_grad_sum")
    wgt = _amp_layer("bwd_weight", True)
    weights = 3 * h * h + h * h + 2 * h * ffn
    biases = 3 * h + h + ffn + h
    assert wgt["amp_weight_cast"].kernels == 12
    assert wgt["amp_weight_cast"].bytes == (weights + biases) * 6
    assert wgt["grad_accum"].bytes == 3 * weights * 4  # fp32 .grad
    # fp32 training under the same stack: autocast changes nothing
    assert _amp_layer("fwd", True, "fp32") == _amp_layer("fwd", False, "fp32")


def test_autocast_optimizer_has_no_16_bit_copy_to_write() -> None:
    from simulator.model.inventory.optimizer import optimizer_op
    from simulator.spec.stack import StackSpec

    amp = StackSpec.model_validate({"preset": "pytorch-eager", "autocast": True})
    plain = StackSpec.model_validate({"preset": "pytorch-eager"})
    # fp32 parameters and grads, torch.optim.AdamW op by op (unfused_bytes: 4m + 3s1 + 5s2
    # + 2g + 6t, every term 4 bytes): 80 bytes, no 16-bit copy; fused, w, m, v read and
    # written and the grad read: 28
    assert optimizer_op(1e6, 10, amp, "bf16").bytes == 80e6
    fused = amp.model_copy(update={"optimizer": "fused"})
    assert optimizer_op(1e6, 10, fused, "bf16").bytes == 28e6
    # bf16 gradients (g = 2) and the 16-bit copy written (2)
    assert optimizer_op(1e6, 10, plain, "bf16").bytes == (16 + 12 + 20 + 4 + 24 + 2) * 1e6


def test_host_cost_cli_writes_the_terms_into_a_profile(tmp_path: Any,
                                                       capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    """`clustersim host-cost PROFILE --device cpu` (what validation does by itself);
    a missing profile is one line and exit status 2."""
    pytest.importorskip("torch")
    import shutil

    from simulator.cli.main import main
    from simulator.system.profiles import SYSTEMS_DIR, load_system

    path = tmp_path / "cpu.yaml"
    shutil.copy(SYSTEMS_DIR / "cpu-1thread.yaml", path)
    assert main(["host-cost", str(path), "--device", "cpu"]) == 0
    assert "us per kernel" in capsys.readouterr().out
    gpu = load_system(str(path)).gpu
    assert gpu.host_serial and gpu.host_overhead_us is not None
    # --refit re-derives from the recorded step times: the same counts, the same figures
    assert main(["host-cost", str(path), "--refit"]) == 0
    again = load_system(str(path)).gpu
    assert (again.host_overhead_us, again.host_optimizer_us) == \
        (gpu.host_overhead_us, gpu.host_optimizer_us)
    bare = tmp_path / "bare.yaml"
    shutil.copy(SYSTEMS_DIR / "cpu-1thread.yaml", bare)
    capsys.readouterr()
    assert main(["host-cost", str(bare), "--refit"]) == 2  # nothing recorded to refit
    assert "records no host-cost step times" in capsys.readouterr().err
    assert main(["host-cost", str(tmp_path / "none.yaml"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err and err.count("\n") == 1


def test_pytorch_cross_entropy_is_log_softmax_and_nll_loss() -> None:
    """The eager stack's loss is F.cross_entropy: forward log_softmax (logits read, fp32
    log-probabilities written) and nll_loss's gather, 2 kernels; backward the zeroed
    gradient and its scatter, then log_softmax's backward, 3 kernels. Megatron's
    vocab-parallel form runs six fp32 kernels each way (an H200 step of gpt-0.9b at
    micro-batches of 8 measured 13 ms of loss kernels, 16 of them)."""
    from simulator.model import transformer as mdl
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.stack import StackSpec, load_stack

    spec = ModelSpec.model_validate({"preset": "tiny-gpt"})
    elements = 2 * spec.seq_len * spec.vocab
    eager = load_stack("pytorch-eager")
    assert eager.loss == "torch"
    fwd = {op.name: op for op in mdl.head_ops(spec, 2, 1, False, "fp32", "fwd", eager)}
    bwd = {op.name: op for op in mdl.head_ops(spec, 2, 1, False, "fp32", "bwd_input", eager)}
    assert (fwd["loss"].kernels, fwd["loss"].bytes) == (2, elements * (4 + 4))
    assert (bwd["loss"].kernels, bwd["loss"].bytes) == (3, elements * (4 + 8 + 4))
    megatron = StackSpec.model_validate({"preset": "pytorch-eager", "loss": "vocab_parallel"})
    old = {op.name: op for op in mdl.head_ops(spec, 2, 1, False, "fp32", "fwd", megatron)}
    assert (old["loss"].kernels, old["loss"].bytes) == (6, elements * (4 + 16))


def test_a_cuda_runs_comparison_draws_its_kernels_not_its_host_ops(tmp_path: Any,
                                                                   monkeypatch: Any) -> None:
    """The comparison carries the run's device, so the plot's measured row is the GPU
    kernels' time (the H200's gpt-0.9b step: 420 ms of kernels, whose host ops end at
    380 ms, which the plot drew before)."""
    import json

    import yaml

    import calibration.measured.compare as cmp

    cfg = _cfg("cuda")
    (tmp_path / "scenario.yaml").write_text(
        yaml.safe_dump(scenario_dict(cfg, device_name="NVIDIA H200")))
    rank = {"compute_s": 0.004, "optimizer_s": 0.0, "profiled_step_s": 0.01}
    (tmp_path / "measured.json").write_text(json.dumps(
        {"step_time_s": 0.005, "device": "cuda", "per_rank": [rank], "state_bytes": [1.0]}))
    (tmp_path / "traces").mkdir()
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1000.0,
               "pid": 1, "tid": 1},
              {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 500.0, "dur": 4000.0,
               "pid": 0, "tid": 7}]
    (tmp_path / "traces" / "trace_rank0.json").write_text(json.dumps({"traceEvents": events}))
    drawn: list[str] = []
    real_rows = cmp._measured_rows

    def rows(run_dir: Any, device: str) -> Any:
        drawn.append(device)
        return real_rows(run_dir, device)

    monkeypatch.setattr(cmp, "_measured_rows", rows)
    comparison = cmp.run_compare(tmp_path, "dgx-h200", plot=True)
    assert comparison["device"] == "cuda" and drawn == ["cuda"]
    [(_, work, _)] = real_rows(tmp_path, "cuda")
    assert work == [(0.0, pytest.approx(4000e-6))]  # the kernel, not the aten op


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_loss_has_a_curve_of_its_own_timed_on_vocabulary_wide_rows(kind: str) -> None:
    """The H200 priced the loss on the softmax curve, timed on rows of a model's width
    (20% of HBM at 1 GB), while log_softmax over 50,304 columns ran at about 60%: the
    loss is its own class, timed as F.cross_entropy over vocabulary-wide fp32 rows."""
    from calibration.microbench.bench_compute import (
        FP32_KERNELS,
        KERNEL_CLASS,
        VOCAB_WIDTH,
        memory_plan,
    )
    from calibration.microbench.bench_timing import Device, budget_for
    from simulator.model import transformer as mdl
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.stack import load_stack

    plan = memory_plan(budget_for(kind, "quick"), Device(kind))
    ce = [(rows, width) for kernel, rows, width in plan if kernel == "cross_entropy"]
    assert ce and {w for _, w in ce} == {VOCAB_WIDTH[kind]}
    assert len(plan) == len(set(plan))  # one row's width covers the smallest sizes once
    assert KERNEL_CLASS["cross_entropy"] == "cross_entropy" and "cross_entropy" in FP32_KERNELS
    spec = ModelSpec.model_validate({"preset": "tiny-gpt"})
    for stack in ("pytorch-eager", "megatron-2021", "megatron-core"):
        ops = mdl.head_ops(spec, 2, 1, False, "bf16", "fwd", load_stack(stack))
        assert {op.cost_class for op in ops if op.name == "loss"} == {"cross_entropy"}

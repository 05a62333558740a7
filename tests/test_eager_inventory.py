"""The ``pytorch-eager`` inventory against what calibration/measured/gpt.py executes.

Closed forms for the eager kernels (bias inside ``addmm``, the gradient sums where
separate q, k, v read one input, the for-loop AdamW's ops per tensor), and a
``torch.profiler`` count of the aten compute ops one more layer adds to a CPU training
step of the measured GPT, put beside the inventory's kernels for that layer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from simulator.model.inventory.dense import dense_layer_ops
from simulator.model.inventory.ops import FLASH_BWD_KERNELS
from simulator.model.inventory.optimizer import optimizer_op
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec, load_stack

TINY = {"layers": 1, "hidden": 64, "heads": 4, "ffn_hidden": 256, "vocab": 128, "seq_len": 32}


def _spec() -> ModelSpec:
    return ModelSpec.model_validate({**TINY, "kv_heads": 4, "activation": "gelu",
                                     "norm": "layernorm", "bias": True,
                                     "tied_embeddings": True, "position": "learned"})


def _kernels(stack: StackSpec, pass_: str) -> Counter[str]:
    ops = dense_layer_ops(_spec(), 2, 1, False, "fp32", pass_, stack)  # type: ignore[arg-type]
    out: Counter[str] = Counter()
    for op in ops:
        out[op.name] += op.kernels
    return out


def test_bias_inside_the_gemm_launches_no_bias_kernel() -> None:
    eager = load_stack("pytorch-eager")
    fwd = _kernels(eager, "fwd")
    assert fwd["act"] == 1 and fwd["residual"] == 2  # F.gelu; x + y twice
    apart = eager.model_copy(update={"fusions": ()})  # a separate bias add before each
    fwd_apart = _kernels(apart, "fwd")
    assert fwd_apart["act"] == 2 and fwd_apart["residual"] == 4


def test_separate_projections_sum_their_input_gradients() -> None:
    eager = load_stack("pytorch-eager")
    assert _kernels(eager, "bwd_input")["qkv_grad_sum"] == 2  # q, k, v: two adds
    fused = eager.model_copy(update={"fusions": ("projections", "bias_gemm")})
    assert _kernels(fused, "bwd_input")["qkv_grad_sum"] == 0  # one QKV GEMM: nothing to sum
    grad_sums = [op for op in dense_layer_ops(_spec(), 2, 1, False, "fp32", "bwd_input", eager)
                 if op.name == "qkv_grad_sum"]
    assert grad_sums[0].bytes == 4 * 3 * 2 * (2 * 32 * 64)  # two adds: read 2, write 1


def test_for_loop_adamw_runs_ten_ops_per_tensor() -> None:
    eager = load_stack("pytorch-eager")
    assert optimizer_op(1e5, 7, eager, "fp32").kernels == 70


# --------------------------------------------------------------- against torch.profiler
#: aten ops that move no data (views, metadata) or only wrap another op
_NOT_KERNELS = {"aten::view", "aten::t", "aten::transpose", "aten::reshape", "aten::expand",
                "aten::as_strided", "aten::_unsafe_view", "aten::detach", "aten::linear",
                "aten::matmul", "aten::layer_norm", "aten::scaled_dot_product_attention",
                "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resolve_conj",
                "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze",
                "aten::contiguous", "aten::to", "aten::lift_fresh", "aten::alias",
                "aten::result_type", "aten::resize_", "aten::size", "aten::stride"}


def _phase_counts(layers: int) -> dict[str, int]:
    """Top-level aten compute ops of one fwd + bwd + AdamW step of the measured GPT."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    from calibration.measured.gpt import GPT, GPTConfig, loss_fn, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(**{**TINY, "layers": layers})
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, 2, 0)
    loss_fn(model(x), y).backward()
    opt.step()  # states exist; the profiled step is a steady one
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("FWD"):
            loss = loss_fn(model(x), y)
        with record_function("BWD"):
            loss.backward()
        with record_function("OPT"):
            opt.step()
    counts: Counter[str] = Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::") or ev.name in _NOT_KERNELS:
            continue
        parent: Any = ev.cpu_parent
        while parent is not None and parent.name in _NOT_KERNELS:
            parent = parent.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            continue  # inside another counted op
        while parent is not None and parent.name not in ("FWD", "OPT"):
            parent = parent.cpu_parent
        counts[parent.name if parent is not None else "BWD"] += 1
    return dict(counts)


def test_one_more_layer_adds_the_inventory_kernels() -> None:
    one, two = _phase_counts(1), _phase_counts(2)
    eager = load_stack("pytorch-eager")
    fwd = sum(_kernels(eager, "fwd").values())
    assert two["FWD"] - one["FWD"] == fwd  # 2 norms, 6 addmm, SDPA, gelu, 2 adds
    # backward: the inventory's dgrad + wgrad + weight-side ops, less AccumulateGrad
    # (grads were set to None, so the first micro-batch's grads are stolen, not added)
    # and less norm_grad (CPU's native_layer_norm_backward computes γ/β grads in its kernel)
    bwd = sum(_kernels(eager, "bwd_input").values())
    weight = _kernels(eager, "bwd_weight")
    bwd += sum(weight.values()) - weight["grad_accum"] - weight["norm_grad"]
    # on CPU the flash backward is one op (_scaled_dot_product_flash_attention_for_cpu_
    # backward); the inventory counts CUDA's three (dO·O preprocess, main, dQ convert)
    cpu_flash_bwd = 1 - FLASH_BWD_KERNELS["flash2"]
    assert two["BWD"] - one["BWD"] == bwd + cpu_flash_bwd
    tensors = 16  # q, k, v, out, up, down weights and biases; two norms' γ and β
    assert two["OPT"] - one["OPT"] == optimizer_op(1e5, tensors, eager, "fp32").kernels


# --------------------------------------------------------------- the CPU host cost
def test_cpu_host_cost_adds_to_each_kernel_at_the_measured_rate() -> None:
    """On a CPU "device" one thread runs the framework and the kernels: an op costs its
    device time plus kernels × the profile's measured host cost (not the stack's GPU
    figure, not a max), and nothing when the stack replays a CUDA graph."""
    from simulator.model.inventory.ops import Op
    from simulator.spec.load import scenario_from_dict
    from simulator.system.costs import CostModel

    s = scenario_from_dict({"name": "t", "model": {"preset": "tiny-gpt"},
                            "cluster": {"system": "cpu-1thread", "nodes": 1,
                                        "gpus_per_node": 2},
                            "parallel": {"dp": 2}, "training": {"global_batch": 4,
                                                                "dtype": "fp32"}})
    assert s.hardware.gpu.host_serial
    big = Op("big", "memory", 0.0, 1e8, 0.0, "elementwise", 4)
    device = CostModel(s.hardware, "fp32").op_time(big)  # no host cost at all
    assert CostModel(s.hardware, "fp32", host_us=10.0).op_time(big) == \
        pytest.approx(device + 4 * 10e-6)  # added, though the device time is far longer
    gpu = s.hardware.gpu.model_copy(update={"host_overhead_us": 3.0})
    hw = s.hardware.model_copy(update={"gpu": gpu})
    assert CostModel(hw, "fp32", host_us=10.0).op_time(big) == pytest.approx(device + 4 * 3e-6)
    assert CostModel(hw, "fp32", host_us=0.0).op_time(big) == pytest.approx(device)


def test_host_bench_counts_the_inventory_kernels_of_its_step() -> None:
    pytest.importorskip("torch")
    from calibration.measured.host_cost import measure_host_us
    from calibration.measured.host_counts import (
        HOST_GPT,
        MICRO_BATCHES,
        split_per_op,
        step_counts,
        step_kernels,
    )

    layers = HOST_GPT["layers"]
    one = step_kernels({**HOST_GPT, "layers": 1})
    assert step_kernels() - one == (layers - 1) * (step_kernels({**HOST_GPT, "layers": 2}) - one)
    counts = step_counts()
    # a later micro-batch adds its gradients (one add per parameter the layers and ends own)
    assert counts.later > counts.first > counts.gemm_later == counts.gemm_first > 0
    assert counts.total(MICRO_BATCHES) == counts.first + 3 * counts.later + counts.optimizer
    host = measure_host_us(1, 0.0, repeats=2, steps=2)
    assert host["kernels"]["first"] == counts.first
    t = host["step_s_min"]
    x, y = split_per_op(t["1"], t[str(MICRO_BATCHES)], MICRO_BATCHES, counts)
    assert host["host_overhead_us"] == pytest.approx(x * 1e6, abs=1e-3)
    assert host["host_optimizer_us"] == pytest.approx(y * 1e6, abs=1e-3)


def test_the_two_micro_batch_counts_tell_the_layers_host_cost_from_the_optimizers() -> None:
    """Closed form: steps timed at 1 and m micro-batches, built from known per-kernel
    costs, give those costs back; a noisy difference below 0 gives 0, never less."""
    from calibration.measured.host_counts import StepCounts, split_per_op

    c = StepCounts(first=200, later=260, optimizer=680)
    x, y = 5e-6, 3e-6
    t1 = c.first * x + c.optimizer * y
    t4 = t1 + 3 * c.later * x
    assert split_per_op(t1, t4, 4, c) == pytest.approx((x, y))
    assert split_per_op(t1, t1 * 0.99, 4, c) == (0.0, pytest.approx(t1 / c.optimizer))
    assert split_per_op(1e-3, 1e-1, 4, c)[1] == 0.0  # micro-batches that explain it all


def test_dtensor_gemms_and_other_ops_are_told_apart_by_the_two_steps() -> None:
    """Closed form of split_gemm: DTensor extras built from a GEMM cost and an other-op
    cost (optimizer included) come back exactly; where noise makes one negative, it is 0
    and the other carries the later micro-batches' cost."""
    from calibration.measured.host_counts import StepCounts, split_gemm, step_counts

    c = step_counts(dtensor=True)
    assert c.gemm_first == c.gemm_later > 0 and c.optimizer > c.first
    xg, xo = 140e-6, 12e-6
    e1 = c.gemm_first * xg + (c.first - c.gemm_first + c.optimizer) * xo
    e4 = e1 + 3 * (c.gemm_later * xg + (c.later - c.gemm_later) * xo)
    assert split_gemm(e1, e4, 4, c) == pytest.approx((xg, xo))
    # later micro-batches cheap against the first step: all on the other ops, GEMMs 0
    g, o = split_gemm(1e-2, 1e-2 + 3 * 1e-4, 4, c)
    assert g == 0.0 and o == pytest.approx(1e-4 / (c.later - c.gemm_later))
    # a one-micro-batch step too short for its GEMMs: the GEMMs carry the later cost
    g, o = split_gemm(1e-4, 1e-4 + 3 * 1e-2, 4, c)
    assert o == 0.0 and g == pytest.approx(1e-2 / c.gemm_later)
    assert split_gemm(1e-3, 1e-3, 4, StepCounts(10, 10, 10, 0, 0)) == (0.0, 0.0)


def test_dtensor_ops_under_tp_and_sequence_parallelism() -> None:
    """TP as DTensor: the sharded linears' GEMMs, bias and weight grads dispatch through
    DTensor; with sequence parallelism the norms and the residual stream do too; the
    optimizer's ops on DTensor parameters as well; nothing without TP or off DTensor."""
    from simulator.model.inventory.layer import layer_tensors
    from simulator.model.inventory.tensor_parallel import dtensor_tensors

    eager, spec = load_stack("pytorch-eager"), _spec()

    def marked(tp: int, sp: bool, stack: StackSpec = eager) -> set[str]:
        return {op.name for p in ("fwd", "bwd_input", "bwd_weight")
                for op in dense_layer_ops(spec, 2, tp, sp, "fp32", p, stack)  # type: ignore[arg-type]
                if op.dtensor == op.kernels > 0}

    assert marked(1, False) == set()
    assert marked(2, False) == {"qkv", "out_proj", "mlp_up", "mlp_down", "bias_grad",
                                "grad_accum"}
    assert marked(2, True) - marked(2, False) == {"ln1", "ln2", "residual", "grad_sum",
                                                  "norm_grad"}
    assert marked(2, True, eager.model_copy(update={"dtensor": False})) == set()
    assert dtensor_tensors(spec, eager, 2, False) == 12  # 6 linears' weights and biases
    assert dtensor_tensors(spec, eager, 2, True) == layer_tensors(spec, eager) == 16
    assert optimizer_op(1e5, 20, eager, "fp32", 12).dtensor == 120


def test_dtensor_host_cost_is_charged_per_dtensor_op() -> None:
    from simulator.model.inventory.ops import Op
    from simulator.spec.load import scenario_from_dict
    from simulator.system.costs import CostModel

    s = scenario_from_dict({"name": "t", "model": {"preset": "tiny-gpt"},
                            "cluster": {"system": "cpu-1thread", "nodes": 1,
                                        "gpus_per_node": 2},
                            "parallel": {"tp": 2}, "training": {"global_batch": 4,
                                                                "dtype": "fp32"}})
    gpu = s.hardware.gpu.model_copy(update={"host_overhead_us": 3.0,
                                            "dtensor_overhead_us": 50.0})
    hw = s.hardware.model_copy(update={"gpu": gpu})
    plain = Op("a", "memory", 0.0, 1e8, 0.0, "elementwise", 4)
    on_dtensor = Op("a", "memory", 0.0, 1e8, 0.0, "elementwise", 4, dtensor=4)
    cost = CostModel(hw, "fp32", host_us=10.0)
    assert cost.op_time(on_dtensor) - cost.op_time(plain) == pytest.approx(4 * 50e-6)
    graphs = CostModel(hw, "fp32", host_us=0.0)  # no host cost at all under CUDA graphs
    assert graphs.op_time(on_dtensor) == graphs.op_time(plain)


def test_gemms_dtensor_cost_and_the_optimizers_host_cost_where_measured_apart() -> None:
    """A GEMM's DTensor dispatch is priced at gpu.dtensor_gemm_us, every other DTensor op
    at dtensor_overhead_us; the optimizer's kernels at host_optimizer_us, every other
    kernel at host_overhead_us; absent, the general figures price all."""
    from simulator.model.inventory.ops import Op
    from simulator.system.costs import CostModel
    from simulator.system.profiles import load_system

    hw = load_system("cpu-1thread")
    gemm = Op("g", "gemm", 1e3, 1e3, 1e3, "gemm_fwd", 2, dtensor=2)
    norm = Op("n", "memory", 0.0, 1e3, 0.0, "norm", 2, dtensor=2)
    opt = Op("o", "memory", 0.0, 1e3, 0.0, "optimizer", 10, dtensor=10)

    def extra(op: Op, **gpu: float) -> float:
        """Seconds the host figures add to the op over no host cost at all."""
        base = hw.model_copy(update={"gpu": hw.gpu.model_copy(update={
            "host_overhead_us": 0.0, "dtensor_overhead_us": 0.0})})
        with_ = hw.model_copy(update={"gpu": hw.gpu.model_copy(update=gpu)})
        return CostModel(with_, "fp32", host_us=10.0).op_time(op) - \
            CostModel(base, "fp32", host_us=10.0).op_time(op)

    one = {"host_overhead_us": 4.0, "dtensor_overhead_us": 12.0}
    apart = {**one, "host_optimizer_us": 1.5, "dtensor_gemm_us": 140.0}
    assert extra(gemm, **one) == pytest.approx(2 * (4.0 + 12.0) * 1e-6)
    assert extra(gemm, **apart) == pytest.approx(2 * (4.0 + 140.0) * 1e-6)
    assert extra(norm, **apart) == pytest.approx(extra(norm, **one))
    assert extra(opt, **one) == pytest.approx(10 * (4.0 + 12.0) * 1e-6)
    assert extra(opt, **apart) == pytest.approx(10 * (1.5 + 12.0) * 1e-6)


def test_fsdp2_optimizer_steps_on_dtensor_parameters() -> None:
    from simulator.model import transformer as mdl
    from simulator.spec.load import scenario_from_dict

    def opt(zero: int, stack: str) -> int:
        s = scenario_from_dict({"name": "t", "model": {"preset": "tiny-gpt"}, "stack": stack,
                                "cluster": {"system": "cpu-1thread", "nodes": 1,
                                            "gpus_per_node": 2},
                                "parallel": {"dp": 2, "zero": zero},
                                "training": {"global_batch": 4, "dtype": "fp32"}})
        op = mdl.optimizer_op_of(s, 1e5, [range(s.model.layers)])
        assert op.dtensor in (0, op.kernels)
        return op.dtensor

    assert opt(0, "pytorch-eager") == 0  # DDP: plain parameters
    assert opt(3, "pytorch-eager") > 0  # FSDP2: sharded DTensor parameters
    assert opt(3, "deepspeed") == 0  # DeepSpeed's ZeRO-3 flattens into plain tensors


def test_validation_adds_the_host_costs_to_its_cpu_profile(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import shutil

    from calibration.measured.host_cost import add_to_profile
    from simulator.system.profiles import SYSTEMS_DIR, load_system

    path = tmp_path / "cpu.yaml"
    shutil.copy(SYSTEMS_DIR / "cpu-1thread.yaml", path)
    host = add_to_profile(str(path), 1)
    gpu = load_system(str(path)).gpu
    assert gpu.host_serial and gpu.host_overhead_us == host["host_overhead_us"] > 0
    assert gpu.dtensor_overhead_us == host["dtensor_overhead_us"] is not None
    assert gpu.dtensor_gemm_us == host["dtensor_gemm_us"] is not None
    assert gpu.host_optimizer_us == host["host_optimizer_us"] is not None
    assert not list(tmp_path.glob(".*tmp*"))


def _tp_collectives(stack: str, sp: bool, layers: int = 4,
                    m: int = 4) -> Counter[tuple[str, float]]:
    """Rank 0's TP collectives of one step of the measured GPT's shape at TP 2."""
    from simulator.builder.workload import build_workload
    from simulator.spec.load import scenario_from_dict

    s = scenario_from_dict({
        "name": "t", "stack": stack,
        "model": {"layers": layers, "hidden": 64, "heads": 4, "ffn_hidden": 256, "vocab": 128,
                  "seq_len": 32, "activation": "gelu", "norm": "layernorm", "bias": True,
                  "tied_embeddings": True, "position": "learned"},
        "cluster": {"system": "cpu-1thread", "nodes": 1, "gpus_per_node": 2},
        "parallel": {"tp": 2, "sequence_parallel": sp},
        "training": {"global_batch": 2 * m, "micro_batch": 2, "dtype": "fp32"}})
    w = build_workload(s)
    return Counter((t.op, t.nbytes) for t in w.tasks if t.plan is not None and t.rank == 0)


def test_dtensor_tp_issues_the_collectives_of_its_parallel_styles() -> None:
    """TP 2 as DTensor, per micro-batch of the measured GPT (L layers, activations
    A = b·s·h, logits b·s·V in fp32), as the profiler of our measured small-gpt run
    counts them (104 gloo all-reduces and 4 all-gathers a step for L = 4, m = 4):
    forward the embedding's all-reduce and two per layer, the logits all-gathered;
    backward the head input's all-reduce and one per ColwiseParallel projection
    (q, k, v and up: four per layer). Megatron's: two per layer each way and the
    vocab-parallel loss's three small ones."""
    L, m, a, logits = 4, 4, 2 * 32 * 64 * 4.0, 2 * 32 * 128 * 4.0
    assert _tp_collectives("pytorch-eager", False) == {
        ("tp.all_reduce", a): m * (1 + 2 * L + 1 + 4 * L), ("tp.all_gather", logits): m}
    assert _tp_collectives("megatron-core", False) == {
        ("tp.all_reduce", a): m * (1 + 2 * L + 1 + 2 * L), ("tp.all_reduce", 2 * 32 * 4.0): 3 * m}


def test_dtensor_sequence_parallel_tp_and_its_partial_norm_gradients() -> None:
    """With sequence parallelism (measured: 76 all-gathers, and 126 all-reduces where
    gloo runs each reduce-scatter as an all-reduce): per layer and pass an all-gather
    before and a reduce-scatter after each block; the embedding's output all-reduced
    (replicated, then cut) and its gradient all-gathered; the head's input gathered,
    the logits gathered, its input gradient reduce-scattered; and AdamW all-reducing
    each norm parameter's partial gradient three times (2·L + 1 layernorms, γ and β)."""
    L, m, a, logits = 4, 4, 2 * 32 * 64 * 4.0, 2 * 32 * 128 * 4.0
    got = _tp_collectives("pytorch-eager", True)
    assert got == {("tp.all_gather", a): m * (4 * L + 2), ("tp.all_gather", logits): m,
                   ("tp.reduce_scatter", a): m * (4 * L + 1), ("tp.all_reduce", a): m,
                   ("tp.all_reduce", 64 * 4.0): 3 * 2 * (2 * L + 1)}
    assert sum(n for (op, _), n in got.items() if op == "tp.all_gather") == 76
    assert sum(n for (op, _), n in got.items() if op != "tp.all_gather") == 126


def test_analytic_counts_the_dtensor_backward_collectives() -> None:
    """The analytic method's TP time per layer follows the same count: forward 2,
    backward 4 (q, k, v, up) under DTensor without sequence parallelism, against
    Megatron's 2 and 2; full recomputation repeats the forward's."""
    from simulator.analysis.analytic.stage import passes as _passes
    from simulator.builder.workload import block_costs
    from simulator.model.inventory.tensor_parallel import tp_block_collectives
    from simulator.spec.load import scenario_from_dict
    from simulator.system.costs import CostModel

    def analytic_tp(stack: str, recompute: str = "none") -> float:
        s = scenario_from_dict({"name": "t", "stack": stack, "model": {"preset": "tiny-gpt"},
                                "cluster": {"system": "cpu-1thread", "nodes": 1,
                                            "gpus_per_node": 2},
                                "parallel": {"tp": 2, "recompute": recompute},
                                "training": {"global_batch": 4, "dtype": "fp32"}})
        cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
        return _passes(s, block_costs(s, cost), 1.0, [(0, 1, recompute)], False,
                       False)["tp_transfer"]

    assert analytic_tp("pytorch-eager") == 2 + 4
    assert analytic_tp("megatron-core") == 2 + 2
    assert analytic_tp("pytorch-eager", "full") == 2 + 2 + 4

    eager, mcore, spec = load_stack("pytorch-eager"), load_stack("megatron-core"), _spec()

    def per_layer(stack: StackSpec, backward: bool, sp: bool = False) -> int:
        return sum(tp_block_collectives(spec, stack, 2, sp, label, backward)
                   for label in ("attn", "mlp"))

    assert (per_layer(eager, False), per_layer(eager, True)) == (2, 4)
    assert (per_layer(mcore, False), per_layer(mcore, True)) == (2, 2)
    assert per_layer(eager, True, sp=True) == 2  # one reduce-scatter per block
    assert tp_block_collectives(spec, eager, 1, False, "attn", True) == 0

"""FSDP1's own kernels around each unit's collectives (``stack.fsdp_flat_param``, the
``composer-fsdp1`` preset; simulator/model/inventory/fsdp1.py), from PyTorch's
torch/distributed/fsdp/_runtime_utils.py and _flat_param.py: the fp32 shard cast to 16
bits before each all-gather (``_use_low_precision_shard``), the unit's gradients
concatenated into the flat parameter's (split backward), cast to the reduce dtype and
pre-divided on the post-backward stream before the reduce-scatter, post-divided, cast to
the fp32 parameter's dtype (PURE) and added to the saved shard after it
(``_reduce_grad``, ``_accumulate_sharded_grad``). Under FSDP mixed precision the wgrad
GEMMs write 16-bit gradients: no fused fp32 ``main_grad`` read-modify-write.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_zero3_communicator import _comm_spans, expected_order
from test_zero3_communicator import fsdp1 as fsdp1_order

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.model import transformer as mdl
from simulator.model.inventory import fsdp1
from simulator.model.inventory.dense import dense_layer_ops
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import fsdp_gather_ops, fsdp_reduce_ops
from simulator.model.memory import stage_params
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.spec.stack import load_stack
from simulator.system.costs import CostModel

COMPOSER = load_stack("composer-fsdp1")
PURE = COMPOSER.model_copy(update={"grad_reduce_dtype": "param"})


def composer(flat: bool, m: int = 3, system: str = "cpu-1thread", dp: int = 2,
             **stack: Any) -> Scenario:
    """A small GPT in bf16 with ZeRO-3 over ``dp`` ranks on the composer-fsdp1 stack."""
    return scenario_from_dict({
        "name": "fsdp1-kernels",
        "model": {"layers": 3, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "cluster": {"system": system, "nodes": 1, "gpus_per_node": dp},
        "parallel": {"dp": dp, "zero": 3},
        "training": {"global_batch": dp * m, "micro_batch": 1, "dtype": "bf16"},
        "stack": {"preset": "composer-fsdp1", "fsdp_flat_param": flat, **stack},
    })


@pytest.mark.parametrize(("world", "pre", "post"), [
    (1, 1, 1), (2, 2, 1), (4, 2, 2), (8, 4, 2), (16, 4, 4), (64, 8, 8), (128, 16, 8),
    (6, 4, 1.5)])
def test_divide_factors(world: int, pre: float, post: float) -> None:
    """``DefaultState._get_gradient_predivide_factor``: doubling while the factor divides
    the world and is below the world over it (6: 1, 2, then 4, which no longer divides);
    the rest after the reduce-scatter."""
    assert fsdp1.divide_factors(world) == (pre, post)


@given(k=st.integers(0, 14))
def test_divide_factors_split_powers_of_two(k: int) -> None:
    pre, post = fsdp1.divide_factors(2 ** k)
    assert pre * post == 2 ** k
    assert pre == 2 ** ((k + 1) // 2)


@given(elements=st.floats(1e3, 1e10), dp=st.integers(2, 4096))
@settings(max_examples=60, deadline=None)
def test_gather_casts_the_fp32_shard(elements: float, dp: int) -> None:
    """Under mixed precision one cast of the fp32 shard to bf16 before each all-gather,
    E/dp·(4 + 2) bytes, and nothing after it (the gathered buffer is the parameters'
    storage); nothing to cast when training in fp32."""
    (op,) = fsdp_gather_ops(COMPOSER, elements, dp, 2, 12)
    assert op.name == "fsdp1_shard_cast"
    assert op.bytes == pytest.approx(elements / dp * 6)
    assert op.kernels == 1 and op.cost_class == "copy"
    assert fsdp_gather_ops(COMPOSER, elements, dp, 4, 12) == ()


def unit_bytes(stack: Any, dp: int, accumulate: bool) -> float:
    """Bytes per parameter of the unit per micro-batch, bf16 gradients, fp32 parameters:
    the concat (2 + 2); in the reduce dtype r: the cast to it (2 + r, if r is not 2), the
    pre-divide (2r, if it divides); on the shard (1/dp of it): the post-divide (2r, if it
    divides), the cast to fp32 (r + 4, if r is not 4), the add (3·4, from the second
    micro-batch)."""
    r = stack.reduce_bytes(2)
    pre, post = fsdp1.divide_factors(dp)
    unsharded = 4 + (2 + r if r != 2 else 0) + (2 * r if pre > 1 else 0)
    shard = (2 * r if post > 1 else 0) + (r + 4 if r != 4 else 0) + (12 if accumulate else 0)
    return unsharded + shard / dp


@given(elements=st.floats(1e3, 1e10), dp=st.integers(2, 4096), accumulate=st.booleans(),
       pure=st.booleans())
@settings(max_examples=80, deadline=None)
def test_reduce_kernels_closed_form(elements: float, dp: int, accumulate: bool,
                                    pure: bool) -> None:
    stack = PURE if pure else COMPOSER
    ops = fsdp_reduce_ops(stack, elements, dp, 2, stack.reduce_bytes(2), 12, accumulate)
    assert sum(op.bytes for op in ops) == pytest.approx(elements * unit_bytes(stack, dp,
                                                                            accumulate))
    assert all(op.kernels == 1 for op in ops)  # one kernel each over the flat parameter
    names = [op.name for op in ops]
    assert ("fsdp1_grad_cast" in names) == (not pure)  # PURE reduces in bf16: no cast
    assert ("fsdp1_shard_grad_cast" in names) == pure  # ... and casts the shard to fp32
    assert ("fsdp1_grad_accum" in names) == accumulate


def test_parts_sit_where_fsdp_issues_them() -> None:
    """The concat on the compute stream; the cast and the pre-divide before the
    reduce-scatter on its stream; the post-divide and the add after it."""
    from simulator.model.inventory.sharding import fsdp_reduce_parts
    compute, before, after = fsdp_reduce_parts(COMPOSER, 1e8, 8, 2, 4, 12, True)
    assert [op.name for op in compute] == ["fsdp1_grad_cat"]
    assert [op.name for op in before] == ["fsdp1_grad_cast", "fsdp1_predivide"]
    assert [op.name for op in after] == ["fsdp1_postdivide", "fsdp1_grad_accum"]


@given(elements=st.floats(1e3, 1e9), dp=st.sampled_from([2, 8, 64, 512]))
@settings(max_examples=40, deadline=None)
def test_bytes_grow_with_the_unit(elements: float, dp: int) -> None:
    """Every kernel reads and writes the unit or its shard: twice the unit, twice the
    bytes."""
    for accumulate in (False, True):
        one, two = (sum(op.bytes for op in fsdp_reduce_ops(COMPOSER, e, dp, 2, 4, 12,
                                                           accumulate))
                    for e in (elements, 2 * elements))
        assert two == pytest.approx(2 * one)


def test_no_fused_main_grad_under_fsdp_mixed_precision() -> None:
    """The wgrad GEMMs write the bf16 gradients of FSDP's bf16 compute parameters; the
    fused fp32 ``main_grad`` read-modify-write is Megatron's (gradient_accumulation_fusion)
    and stays there, and under fp32 training."""
    spec = composer(True).model

    def names(stack: Any, dtype: str) -> list[str]:
        return [op.name for op in dense_layer_ops(spec, 1, 1, False, dtype, "bwd_weight",
                                                  stack)]
    assert "main_grad" not in names(COMPOSER, "bf16")
    assert "main_grad" in names(load_stack("megatron-core"), "bf16")
    assert not COMPOSER.fused_main_grads(2) and load_stack("megatron-core").fused_main_grads(2)


def _kernel_seconds(s: Scenario) -> float:
    """FSDP1's kernels of one rank's step from the inventory: per micro-batch each
    layer's two gathers and the root's one, each layer's and the root's reduction, the
    adds from the second micro-batch on."""
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    dp, dt = s.parallel.dp, dtype_bytes(s.training.dtype)
    rdt = s.stack.reduce_bytes(dt)
    unit, n = mdl.layer_params(s.model), layer_tensors(s.model, s.stack)
    root = mdl.embedding_params(s.model) + mdl.head_params(s.model)
    layers = s.model.layers
    total = 0.0
    for mb in range(s.microbatches):
        total += 2 * layers * cost.ops_time(fsdp_gather_ops(s.stack, unit, dp, dt, n))
        total += cost.ops_time(fsdp_gather_ops(s.stack, root, dp, dt, 4))
        total += layers * cost.ops_time(fsdp_reduce_ops(s.stack, unit, dp, dt, rdt, n, mb > 0))
        total += cost.ops_time(fsdp_reduce_ops(s.stack, root, dp, dt, rdt, 4, mb > 0))
    return total


def _optimizer_seconds(s: Scenario) -> float:
    """The rank's optimizer step (under FSDP1's flat parameters it steps and clips only
    the tensors its shard holds a piece of: ``optimizer.in_flat_shard``)."""
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    shard = stage_params(s.model, 1, 0) / s.parallel.dp
    return cost.op_time(mdl.optimizer_op_of(s, shard, [range(s.model.layers)]))


@pytest.mark.parametrize("method", ["engine", "analytic"])
def test_cpu_step_grows_by_exactly_the_kernels(method: str) -> None:
    """On a CPU "device" every task runs in line on one stream: the kernels add their
    inventory time to the step, no more and no less, in both methods, beside the
    optimizer's change (fewer tensors a rank steps under the flat parameters)."""
    with_, without = (simulate_scenario(composer(f), method)[0]["step_time_s"]
                      for f in (True, False))
    fewer = _optimizer_seconds(composer(True)) - _optimizer_seconds(composer(False))
    assert fewer < 0
    assert with_ - without == pytest.approx(_kernel_seconds(composer(True)) + fewer, rel=1e-9)


@given(m=st.integers(1, 5))
@settings(max_examples=5, deadline=None)
def test_each_micro_batch_reduces_and_later_ones_add(m: int) -> None:
    """Composer reduces every micro-batch under FSDP (no ``no_sync``): one more
    micro-batch adds one more of every kernel, the adds included after the first."""
    one, more = (_kernel_seconds(composer(True, k)) for k in (m, m + 1))
    s = composer(True)
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    unit, n = mdl.layer_params(s.model), layer_tensors(s.model, s.stack)
    add = fsdp_reduce_ops(s.stack, unit, 2, 2, 4, n, True)
    assert more - one > cost.ops_time(add) * s.model.layers > 0


def test_engine_places_each_kernel_on_its_stream() -> None:
    """On a GPU: the concat right after its layer's backward on the compute stream, the
    cast and pre-divide right after it there (FSDP1 issues them on its post-backward
    stream, but their blocks fit on no SM beside the compute's: they take their time
    from the compute stream), which the reduce-scatter waits for; the post-divide and
    add after it on its stream; the shard cast before each gather on the gathers'
    stream (over 4 ranks FSDP1 divides by 2 before and 2 after)."""
    s = composer(True, system="dgx-a100-80gb", dp=4)
    w = build_workload(s)
    rank = min(w.programs)
    streams = w.programs[rank].streams
    m, layers = s.microbatches, s.model.layers
    compute = list(streams["compute"])
    cats = [i for i, t in enumerate(compute) if t.name.startswith("fsdp.grad_cat")]
    assert len(cats) == m * (layers + 1)
    assert all(compute[i - 1].kind == "backward" and not compute[i - 1].name.startswith(
        "fsdp") for i in cats)
    pres = [compute[i + 1] for i in cats]
    assert all(t.name.startswith("fsdp.grad_cast+predivide") for t in pres)
    dp = list(streams["dp"])
    assert not any(t.name.startswith("fsdp.grad_cast") for t in dp)
    reduces = [(i, t) for i, t in enumerate(dp) if t.op == "dp.reduce_scatter"]
    assert len(reduces) == len(pres)
    for (i, t), pre in zip(reduces, pres, strict=True):
        assert pre.id in t.deps
        first = pre.name.endswith(" mb0")  # no add on the first micro-batch
        assert dp[i + 1].name.startswith("fsdp.postdivide " if first
                                         else "fsdp.postdivide+grad_accum ")
    casts = [t for t in streams["zero"] if t.name.startswith("fsdp.shard_cast")]
    gathers = [t for t in streams["zero"] if t.op == "zero.all_gather"]
    assert len(casts) == len(gathers) == m * (2 * layers + 1)


@settings(max_examples=4, deadline=None)
@given(layers=st.integers(2, 4), flat=st.booleans())
def test_kernels_keep_fsdp_issue_order(layers: int, flat: bool) -> None:
    """A unit's reduce-scatter is issued at its last gradient (the post-backward hook),
    however many kernels FSDP runs before it on the compute stream (FSDP1's concat,
    FSDP2's pack): one communicator runs a backward's collectives A₀ A₁ R₀ A₂ R₁ …, the
    pack or concat no longer pushing each reduce-scatter behind the next gather."""
    s = fsdp1_order(layers, 1)
    if not flat:  # FSDP2's copies instead of FSDP1's kernels
        s = scenario_from_dict({**s.model_dump(mode="json", exclude_none=True),
                                "stack": {"preset": "pytorch-eager", "fsdp_copies": True}})
    spans = _comm_spans(s)
    seq = ["AG" if op.endswith("all_gather") else "RS" for op in spans["op"]]
    assert seq == expected_order(layers, 1, 1)


def _reduce_seconds(s: Scenario, part: int) -> float:
    """One rank's step of FSDP1's reduction kernels of one part (0: the compute
    stream's concat, 1: the cast and pre-divide before the reduce-scatter, 2: those
    after it), every unit, every micro-batch."""
    from simulator.model.inventory.sharding import fsdp_reduce_parts
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    dp, dt = s.parallel.dp, dtype_bytes(s.training.dtype)
    rdt = s.stack.reduce_bytes(dt)
    unit, n = mdl.layer_params(s.model), layer_tensors(s.model, s.stack)
    root = mdl.embedding_params(s.model) + mdl.head_params(s.model)
    return sum(cost.ops_time(fsdp_reduce_parts(s.stack, e, dp, dt, rdt, k, mb > 0)[part]) * c
               for mb in range(s.microbatches)
               for e, k, c in ((unit, n, s.model.layers), (root, 4, 1)))


def _gpu(flat: bool = True) -> Scenario:
    """A 2,048-wide model on one DGX H100 under composer-fsdp1 (ZeRO-3 over 8)."""
    s = composer(flat, system="dgx-h100", dp=8)
    return scenario_from_dict({**s.model_dump(mode="json", exclude_none=True), "model": {
        "layers": 4, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 2048}})


def test_gpu_cast_and_predivide_take_the_compute_streams_time() -> None:
    """On a GPU the cast and pre-divide run on FSDP1's post-backward stream, but their
    blocks fit on no SM beside the compute kernels issued after them (a GEMM's or an
    attention kernel's CTA holds its SM's registers and shared memory), so the SMs run
    them in turn: the engine's compute stream carries them, each right after its unit's
    concat, and the step is at least that stream's work; only the shard-sized kernels
    after each reduce-scatter stay beside it."""
    s = _gpu()
    w = build_workload(s)
    compute = list(w.programs[min(w.programs)].streams["compute"])
    fsdp = [t for t in compute if t.name.startswith(("fsdp.grad_cat", "fsdp.grad_cast"))]
    in_line = _reduce_seconds(s, 0) + _reduce_seconds(s, 1)
    assert _reduce_seconds(s, 1) > 0.5 * _reduce_seconds(s, 0) > 0
    assert sum(t.duration for t in fsdp) == pytest.approx(in_line, rel=1e-9)
    step = simulate_scenario(s, "engine")[0]["step_time_s"]
    assert step >= sum(t.duration for t in compute) - 1e-9


def test_gpu_closed_form_charges_the_cast_and_predivide() -> None:
    """The closed form charges the same kernels to the step where the collectives hide
    behind the compute: the concat, cast and pre-divide of every unit and micro-batch,
    and nothing of FSDP1's after a gather (its gathered buffer is the parameters')."""
    from simulator.strategies.zero3.strategy import fsdp_copies
    s = _gpu()
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    fwd, bwd = fsdp_copies(s, cost, 0, s.model.layers, True)
    assert fwd == 0.0
    assert bwd == pytest.approx(_reduce_seconds(s, 0) + _reduce_seconds(s, 1), rel=1e-9)

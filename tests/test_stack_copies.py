"""The framework's copies around its gradient and parameter collectives: FSDP2's
(``stack.fsdp_copies``) and torch DDP's bucket copies (``stack.ddp_copies``).

FSDP2 packs each unit (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the
shard is copied into the all-gather buffer (``all_gather_copy_in``), the gathered buffer
split into the parameters (``split_with_sizes_copy``), the gradients packed for the
reduce-scatter (``chunk_cat``) and, on micro-batches after the first, the reduced shard
added to ``.grad``. The profiler of our measured FSDP2 run on CPU shows all four
(``fsdp::all_gather_copy_in``, ``fsdp::split_with_sizes_copy``, ``fsdp::chunk_cat``,
``aten::add_``) at 6-9% of the small GPT's step; without them the FSDP2 rows of the CPU
validation read 16-21% short.

torch DDP (``gradient_as_bucket_view=False``, its default) copies each gradient into
its bucket, scaled by 1/N (``torch::distributed::reducer::mul_out``), and the reduced
buckets back (``torch.distributed.ddp.reducer::copy_bucket_to_grad``), one kernel per
tensor each: the profiler of our tiny-gpt DDP run shows 68 of each, ~1 ms of 59.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import ddp_copy_ops, fsdp_gather_ops, fsdp_reduce_ops
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.spec.stack import load_stack
from simulator.system.costs import CostModel


def fsdp2(copies: bool, m: int = 3, layers: int = 3, system: str = "cpu-1thread",
          **parallel: Any) -> Scenario:
    """A small GPT with ZeRO-3 on the pytorch-eager stack (our measured runs' FSDP2)."""
    return scenario_from_dict({
        "name": "fsdp2-copies",
        "model": {"layers": layers, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "cluster": {"system": system, "nodes": 1, "gpus_per_node": 2},
        "parallel": {"dp": 2, "zero": 3, **parallel},
        "training": {"global_batch": 2 * m, "micro_batch": 1, "dtype": "fp32"},
        "stack": {"preset": "pytorch-eager", "fsdp_copies": copies},
    })


@given(elements=st.floats(1e3, 1e10), dp=st.integers(2, 4096), tensors=st.integers(1, 64),
       dt=st.sampled_from([2, 4]))
@settings(max_examples=60, deadline=None)
def test_gather_copies_closed_form(elements: float, dp: int, tensors: int, dt: int) -> None:
    """The shard in (2·E/dp·dt), the whole unit out (2·E·dt), the shard's cast first under
    a MixedPrecisionPolicy (fp32 shards, 16-bit compute: torchtitan), host work per tensor."""
    eager, titan = load_stack("pytorch-eager"), load_stack("torchtitan")
    ops = fsdp_gather_ops(eager, elements, dp, dt, tensors)
    assert [op.name for op in ops] == ["fsdp_copy_in", "fsdp_copy_out"]
    assert ops[0].bytes == pytest.approx(2 * elements / dp * dt)
    assert ops[1].bytes == pytest.approx(2 * elements * dt)
    assert all(op.cost_class == "copy" and op.kernels == 1 and op.host_ops == tensors
               for op in ops)
    mixed = fsdp_gather_ops(titan, elements, dp, dt, tensors)
    if dt == 2:
        assert mixed[0].name == "fsdp_cast_in"
        assert mixed[0].bytes == pytest.approx(elements / dp * (4 + 2))
        assert mixed[1:] == ops
    else:
        assert mixed == ops
    assert fsdp_gather_ops(load_stack("deepspeed"), elements, dp, dt, tensors) == ()


@given(elements=st.floats(1e3, 1e10), dp=st.integers(2, 4096), tensors=st.integers(1, 64),
       grad=st.sampled_from([2, 4]), reduce=st.sampled_from([2, 4]), accumulate=st.booleans())
@settings(max_examples=60, deadline=None)
def test_reduce_copies_closed_form(elements: float, dp: int, tensors: int, grad: int,
                                   reduce: int, accumulate: bool) -> None:
    """The gradients packed in the reduce dtype (E·(grad + reduce) bytes); on a later
    micro-batch each tensor's shard added to .grad (3·E/dp·reduce, one add per tensor)."""
    ops = fsdp_reduce_ops(load_stack("pytorch-eager"), elements, dp, grad, reduce, tensors,
                          accumulate)
    assert ops[0].name == "fsdp_chunk_cat"
    assert ops[0].bytes == pytest.approx(elements * (grad + reduce))
    assert len(ops) == 1 + accumulate
    if accumulate:
        assert ops[1].bytes == pytest.approx(3 * elements / dp * reduce)
        assert ops[1].kernels == tensors
    assert fsdp_reduce_ops(load_stack("megatron-core"), elements, dp, grad, reduce, tensors,
                           accumulate) == ()


def _copies_seconds(s: Scenario) -> float:
    """The copies of one rank's step, summed from the inventory: per micro-batch the
    gathers (each layer before forward and backward, the root once) and the reduces
    (each layer and the root), the accumulates on every micro-batch after the first."""
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    dp, dt = s.parallel.dp, dtype_bytes(s.training.dtype)
    unit, n = mdl.layer_params(s.model), layer_tensors(s.model, s.stack)
    root = mdl.embedding_params(s.model) + mdl.head_params(s.model)
    m, layers = s.microbatches, s.model.layers
    total = 0.0
    for mb in range(m):
        total += 2 * layers * cost.ops_time(fsdp_gather_ops(s.stack, unit, dp, dt, n))
        total += cost.ops_time(fsdp_gather_ops(s.stack, root, dp, dt, 4))
        total += layers * cost.ops_time(fsdp_reduce_ops(s.stack, unit, dp, dt, dt, n, mb > 0))
        total += cost.ops_time(fsdp_reduce_ops(s.stack, root, dp, dt, dt, 4, mb > 0))
    return total


def test_cpu_step_grows_by_exactly_the_copies() -> None:
    """On a CPU "device" every task runs in line on one stream, so the copies add their
    inventory time to the step, no more and no less."""
    with_, without = (simulate_scenario(fsdp2(c))[0]["step_time_s"] for c in (True, False))
    assert with_ - without == pytest.approx(_copies_seconds(fsdp2(True)), rel=1e-9)


def test_analytic_counts_the_same_copies() -> None:
    """The analytic estimate adds the same seconds on a device that runs them in line."""
    with_, without = (simulate_scenario(fsdp2(c), "analytic")[0]["step_time_s"]
                      for c in (True, False))
    assert with_ - without == pytest.approx(_copies_seconds(fsdp2(True)), rel=1e-9)


def test_pack_runs_after_its_layer_not_after_the_backward() -> None:
    """The gradient pack of a layer sits right after that layer's backward on the compute
    stream (FSDP2's post-backward hook), and its reduce-scatter waits for it, so the
    reduction of one layer can overlap the next layer's backward; a pack placed after the
    whole backward held every reduce-scatter back (a 70B FSDP2 step read +14%)."""
    s = fsdp2(True, system="dgx-a100-80gb")
    w = build_workload(s)
    rank = min(w.programs)
    compute = list(w.programs[rank].streams["compute"])
    packs = [i for i, t in enumerate(compute) if t.name.startswith("fsdp.chunk_cat")]
    assert len(packs) == s.microbatches * (s.model.layers + 1)
    for i in packs:
        before = compute[i - 1]
        assert before.kind == "backward" and not before.name.startswith("fsdp")
    by_id = {t.id: t for t in w.tasks}
    for t in w.tasks:
        if t.rank == rank and t.op == "dp.reduce_scatter":
            assert any(by_id[d].name.startswith("fsdp.chunk_cat") for d in t.deps)


def test_copy_out_precedes_the_layer_and_waits_for_its_gather() -> None:
    s = fsdp2(True, system="dgx-a100-80gb")
    w = build_workload(s)
    rank = min(w.programs)
    by_id = {t.id: t for t in w.tasks}
    outs = [t for t in w.programs[rank].streams["compute"]
            if t.name.startswith("fsdp.copy_out")]
    m, layers = s.microbatches, s.model.layers
    assert len(outs) == m * (2 * layers + 1)
    assert all(by_id[t.deps[0]].op == "zero.all_gather" for t in outs)
    ins = [t for t in w.programs[rank].streams["zero"] if t.name.startswith("fsdp.copy_in")]
    assert len(ins) == len(outs)


def test_no_copies_without_zero3_or_the_stack_flag() -> None:
    for s in (fsdp2(False), fsdp2(True, zero=2)):
        w = build_workload(s)
        assert not any(t.name.startswith("fsdp.") for t in w.tasks)


# ------------------------------------------------------------------ DDP's bucket copies


def ddp(copies: bool, m: int = 3, layers: int = 3, system: str = "cpu-1thread",
        **parallel: Any) -> Scenario:
    """The same GPT under DDP (ZeRO-0) on the pytorch-eager stack."""
    s = fsdp2(copies, m, layers, system, **parallel)
    return scenario_from_dict({**s.model_dump(mode="json", exclude_none=True),
                               "parallel": {"dp": 2, "zero": 0, **parallel},
                               "stack": {"preset": "pytorch-eager", "ddp_copies": copies}})


@given(elements=st.floats(1e3, 1e10), tensors=st.integers(1, 64), dt=st.sampled_from([2, 4]),
       back=st.booleans())
@settings(max_examples=40, deadline=None)
def test_ddp_copies_closed_form(elements: float, tensors: int, dt: int, back: bool) -> None:
    """Every element read and written once, one kernel per tensor, either way; none for a
    stack that reduces from its own buffers (Megatron's contiguous grad buffer)."""
    (op,) = ddp_copy_ops(load_stack("pytorch-eager"), elements, dt, tensors, back)
    assert op.bytes == pytest.approx(2 * elements * dt)
    assert op.kernels == tensors
    assert op.name == ("ddp_bucket_out" if back else "ddp_bucket_in")
    assert ddp_copy_ops(load_stack("megatron-core"), elements, dt, tensors, back) == ()


def _ddp_seconds(s: Scenario) -> float:
    """The copies of one DDP step: each layer's (the head's final norm with the first
    reduced), the embedding's, in and back."""
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    dt, n = dtype_bytes(s.training.dtype), layer_tensors(s.model, s.stack)
    layer = mdl.layer_params(s.model)
    units = [(layer + mdl.head_params(s.model), n + 2)] + [(layer, n)] * (s.model.layers - 1) \
        + [(mdl.embedding_params(s.model), 2)]
    return sum(cost.ops_time(ddp_copy_ops(s.stack, e, dt, k, back))
               for e, k in units for back in (False, True))


@pytest.mark.parametrize("method", ["engine", "analytic"])
def test_ddp_cpu_step_grows_by_exactly_the_copies(method: str) -> None:
    with_, without = (simulate_scenario(ddp(c), method)[0]["step_time_s"] for c in (True, False))
    assert with_ - without == pytest.approx(_ddp_seconds(ddp(True)), rel=1e-9)


def test_ddp_copies_only_on_the_reducing_backward() -> None:
    """Under no_sync the earlier micro-batches' gradients accumulate in place: the copies
    come with the one reduction, each bucket's right after its last gradient and before
    its all-reduce, the copy back after every bucket's all-reduce and before the step."""
    s = ddp(True, system="dgx-a100-80gb")
    w = build_workload(s)
    rank = min(w.programs)
    by_id = {t.id: t for t in w.tasks}
    compute = list(w.programs[rank].streams["compute"])
    ins = [t for t in compute if t.name == "ddp.bucket_in"]
    reduces = [t for t in w.programs[rank].streams["dp"] if t.op == "dp.all_reduce"]
    assert len(ins) == len(reduces) >= 1
    assert all(any(by_id[d].name == "ddp.bucket_in" for d in t.deps) for t in reduces)
    assert all(t.microbatch == s.microbatches - 1 for t in ins)
    (back,) = [t for t in compute if t.name == "ddp.bucket_out"]
    assert {t.id for t in reduces} <= set(back.deps)
    assert compute.index(back) == len(compute) - 2 and compute[-1].op == "optimizer"

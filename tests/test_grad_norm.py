"""Clipping ZeRO-3's gradient shards: the norm's all-reduce over the shard group, on the
compute stream between the backward's reductions and the optimizer step
(simulator/strategies/data/grad_norm.py; FSDP1 ``clip_grad_norm_``'s
``dist.all_reduce(total_norm, group=self.process_group)``, torch v2.1.0).

The oracle for its time is NCCL's tuning model for a 4-byte all-reduce across nodes,
a tree in LL (``src/graph/tuning.cc``: ``baseLat`` 6.8 µs, 2(k − 1) NVLink hops of
hwLat 0.6 µs × 1.8 across nodes, 2 log2 N network hops of 5.0 µs); on the DGX presets a
link's α is NCCL's own ring/Simple hop (3.4 µs NVLink, 14 µs network), so the table
applies unscaled.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload, layout_of
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.data.grad_norm import GRAD_NORM_BYTES, grad_norm_time


def scenario(nodes: int = 1, zero: int = 3, clip: bool = True, **parallel: Any) -> Scenario:
    per_node = 8 if nodes > 1 else 4
    dp = nodes * per_node
    return scenario_from_dict({
        "name": "grad-norm",
        "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "cluster": {"system": "dgx-h100", "nodes": nodes, "gpus_per_node": per_node},
        "parallel": {"dp": dp, "zero": zero, **parallel},
        "training": {"global_batch": 2 * dp, "micro_batch": 1},
        "stack": {"preset": "composer-fsdp1", "grad_clip": clip},
    })


@pytest.mark.parametrize("nodes", [2, 4, 16, 64])
def test_time_is_nccls_tree_ll_latency(nodes: int) -> None:
    """6.8 + 2·7·0.6·1.8 + 2·log2(N)·5.0 µs (the 4 bytes' transfer is below 1e-9 s)."""
    s = scenario(nodes)
    expected_us = 6.8 + 2 * 7 * 0.6 * 1.8 + 2 * (nodes.bit_length() - 1) * 5.0
    assert grad_norm_time(s, layout_of(s), s.hardware) == pytest.approx(expected_us * 1e-6,
                                                                        rel=1e-4)


def test_engine_issues_it_between_the_reductions_and_the_step() -> None:
    """One 4-byte all-reduce over the shard group per step, on the compute stream, after
    the last reduce-scatter and just before the optimizer step."""
    s = scenario(nodes=2)
    w = build_workload(s, fidelity="full")
    compute = w.programs[0].streams["compute"]
    norms = [t for t in compute if t.name == "dp.grad_norm"]
    assert len(norms) == 1
    norm = norms[0]
    assert (norm.op, norm.nbytes, norm.group) == ("dp.all_reduce", GRAD_NORM_BYTES,
                                                  layout_of(s).shard_group(0))
    after = compute[compute.index(norm) + 1]
    assert after.kind == "optimizer"
    last_scatter = [t for t in w.programs[0].streams["dp"] if t.op == "dp.reduce_scatter"][-1]
    assert last_scatter.id in norm.deps


@pytest.mark.parametrize("case", [{"clip": False}, {"zero": 1}, {"zero": 0}],
                         ids=["no-clipping", "zero1", "ddp"])
def test_none_without_clipping_or_sharded_gradients(case: dict[str, Any]) -> None:
    s = scenario(nodes=2, **case)
    w = build_workload(s, fidelity="full")
    assert not [t for t in w.tasks if t is not None and t.name == "dp.grad_norm"]
    assert grad_norm_time(s, layout_of(s), s.hardware) == 0.0


def test_engine_and_closed_form_both_charge_it() -> None:
    """Clipping adds its kernels to the optimizer and the norm's all-reduce, whole, to
    the exposed data-parallel transfer, in both methods (nothing overlaps it: it waits
    for every reduction and the step waits for it)."""
    on, off = scenario(nodes=2), scenario(nodes=2, clip=False)
    t = grad_norm_time(on, layout_of(on), on.hardware)
    for method in ("engine", "analytic"):
        with_norm, _ = simulate_scenario(on, method)
        without, _ = simulate_scenario(off, method)
        a, b = with_norm["step_breakdown_s"], without["step_breakdown_s"]
        assert a["dp_transfer"] - b["dp_transfer"] == pytest.approx(t, rel=1e-9), method
        assert with_norm["step_time_s"] - without["step_time_s"] == pytest.approx(
            t + a["optimizer"] - b["optimizer"], rel=1e-9), method


@given(nodes=st.integers(2, 256), more=st.integers(1, 256))
@settings(max_examples=40, deadline=None)
def test_more_nodes_never_shorten_it(nodes: int, more: int) -> None:
    """A latency-bound tree: a larger shard group never all-reduces the norm faster."""
    a, b = scenario(nodes), scenario(nodes + more)
    assert grad_norm_time(b, layout_of(b), b.hardware) \
        >= grad_norm_time(a, layout_of(a), a.hardware) > 0

"""ZeRO-3 / FSDP2's root unit: the parameters outside the transformer layers.

FSDP2 (``fully_shard`` on each block, then on the stage's module, as our measured
runs wrap the model: calibration/measured/parallel_worker.py ``apply_dp``) shards
the root's parameters (embedding, final norm, output layer) like the blocks'. The
root is gathered in its pre-forward and, unlike the blocks, not resharded after
forward (torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``FSDPState._lazy_init``
sets the root's ``post_forward_mesh_info`` to None), so its backward needs no
second gather; its gradients are reduce-scattered in the root's post-backward
callback (``_root_post_backward_final_callback``), once per micro-batch. A step of
L layers and m micro-batches therefore issues m(1 + 2L) all-gathers and m(1 + L)
reduce-scatters per rank: 36 and 20 for our small GPT's 4 layers and 4 micro-batches
(the profiler of the measured run counts 36 all-gathers).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import simulate_scenario
from simulator.builder.workload import layout_of
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.counts import zero3_collective_counts


def fsdp2(layers: int, m: int, pp: int = 1, dp: int = 2, stack: str = "pytorch-eager",
          **parallel: Any) -> Scenario:
    """A small GPT on the pytorch-eager stack (our measured runs' FSDP2) with ZeRO-3."""
    return scenario_from_dict({
        "name": "fsdp2-root",
        "model": {"layers": layers, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": pp * dp},
        "parallel": {"pp": pp, "dp": dp, "zero": 3, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1},
        "stack": stack,
    })


def counts(s: Scenario) -> dict[int, dict[str, int]]:
    """Per simulated rank: all-gathers and reduce-scatters of the step (any kind), and
    the gradients' all-reduces (hybrid sharding's)."""
    _, spans = simulate_scenario(s)
    assert spans is not None
    return {int(rank): {"all_gather": int(g["op"].str.endswith(".all_gather").sum()),
                        "reduce_scatter": int(g["op"].str.endswith(".reduce_scatter").sum()),
                        "all_reduce": int((g["op"] == "dp.all_reduce").sum())}
            for rank, g in spans.groupby("rank")}


def test_fsdp2_small_gpt_issues_what_the_measured_run_does() -> None:
    """4 layers × 4 micro-batches: 36 all-gathers (4 × (1 root + 4 forward + 4 backward))
    and 20 reduce-scatters (4 × (4 layers + 1 root)) per rank, none after the step."""
    s = fsdp2(4, 4)
    _, spans = simulate_scenario(s)
    assert spans is not None
    for _, g in spans.groupby("rank"):
        ag = g[g["op"] == "zero.all_gather"]
        assert len(ag) == 36
        assert (ag["layer"] < 0).sum() == 4  # the root's, one per micro-batch
        assert (g["op"] == "dp.reduce_scatter").sum() == 20
        assert not (g["op"] == "dp.all_gather").any()  # nothing gathered after the step
        root_rs = g[g["name"].str.contains(" root ") & (g["op"] == "dp.reduce_scatter")]
        assert sorted(root_rs["microbatch"]) == [0, 1, 2, 3]


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 6), m=st.integers(1, 5))
def test_closed_form_counts(layers: int, m: int) -> None:
    """m(1 + 2L) all-gathers and m(1 + L) reduce-scatters, engine and analytic alike."""
    s = fsdp2(layers, m)
    expected = {"all_gather": m * (1 + 2 * layers), "reduce_scatter": m * (1 + layers),
                "all_reduce": 0}
    assert zero3_collective_counts(s, 0) == expected
    assert set(map(tuple, (sorted(c.items()) for c in counts(s).values()))) \
        == {tuple(sorted(expected.items()))}


@pytest.mark.parametrize("case", [
    pytest.param({"pp": 2}, id="pp2-1f1b"),
    pytest.param({"pp": 4, "m": 4}, id="pp4-middle-stages-no-root"),
    pytest.param({"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "m": 4},
                 id="interleaved"),
    pytest.param({"pp": 2, "schedule": "zb-h1"}, id="zb-h1"),
    pytest.param({"reshard_after_forward": False}, id="no-reshard"),
    pytest.param({"stack": "deepspeed"}, id="deepspeed-per-module"),
])
def test_analytic_counts_agree_with_the_engine(case: dict[str, Any]) -> None:
    """The analytic method's ZeRO-3 collective counts are the engine workload's, per
    pipeline stage: a stage's root (the first stage's embedding, the last's head) is
    gathered once per micro-batch, middle stages have none."""
    case = {"m": 3, **case}
    s = fsdp2(8, **case)
    layout = layout_of(s)
    got = counts(s)
    assert {layout.coord(rank).pp for rank in got} == set(range(s.parallel.pp))
    for rank, c in got.items():
        assert c == zero3_collective_counts(s, layout.coord(rank).pp), rank


def test_root_gather_waits_for_the_compute_before_it() -> None:
    """The root's gather cannot be prefetched: FSDP2's root pre-forward makes the
    all-gather stream wait for the current stream, so each micro-batch's root gather
    starts after the previous micro-batch's backward and delays the next forward."""
    s = fsdp2(4, 3)
    _, spans = simulate_scenario(s)
    assert spans is not None
    rank0 = spans[spans["rank"] == 0]
    comp = rank0[rank0["stream"] == "compute"]
    root = rank0[(rank0["op"] == "zero.all_gather") & (rank0["layer"] < 0)]
    for _, row in root.iterrows():
        mb = row["microbatch"]
        first_fwd = comp[(comp["op"] == "F") & (comp["microbatch"] == mb)]["start"].min()
        prev_bwd = comp[(comp["op"] == "B") & (comp["microbatch"] == mb - 1)]["end"]
        assert row["end"] <= first_fwd + 1e-15
        if len(prev_bwd):
            assert row["start"] >= prev_bwd.max() - 1e-15
    assert isinstance(root, pd.DataFrame) and len(root) == 3

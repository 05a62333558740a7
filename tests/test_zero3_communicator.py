"""ZeRO-3's gathers and reduce-scatters over one shard group run in one NCCL
communicator's order (simulator/strategies/zero3/communicator.py).

NCCL orders the kernels of one communicator whatever stream each is launched on
(NVIDIA/nccl v2.18.1-1 ``src/enqueue.cc``: each launch acquires the communicator's
``sharedRes->deviceStream``), and FSDP issues both collectives over its one process
group. With one unit prefetched, FSDP1 issues unit j's backward gather before unit
j + 1's reduce-scatter (BACKWARD_PRE in j + 1's pre-backward hook, BACKWARD_POST in its
post-backward hook ahead of the reduce-scatter, ``_runtime_utils._post_backward_hook``
→ ``_post_backward_reshard`` → ``_prefetch_handle`` before ``_reduce_grad``): a
backward of gathers A₀ A₁ … and reduce-scatters R₀ R₁ … (the root's last) runs
A₀ A₁ R₀ A₂ R₁ A₃ R₂ …, and the next micro-batch's first gather after the root's
reduce-scatter.
"""

from __future__ import annotations

import itertools
from typing import Any

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import simulate_scenario
from simulator.builder.tasks import Task
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3 import strategy as z3
from simulator.strategies.zero3.communicator import one_communicator


def _task(i: int, stream: str, deps: list[int] | None = None) -> Task:
    return Task(i, 0, stream, stream, stream, f"t{i}", deps=deps or [])  # type: ignore[arg-type]


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_issue_order_closed_form(ahead: int) -> None:
    """As the workload builds them: forward gathers F₀ F₁ F₂; a backward of three units,
    gather A_k then the compute C_k that completes unit k's gradients; reduce-scatters
    R₀ R₁ R₂ (each after its C_k) and the root's R₃ (after C₂); the next forward's
    gather G. FSDP issues A₀ … A_ahead, then R_k followed by A_{k+ahead+1}, R₃, G; each
    collective waits for the one before it on the other stream."""
    fwd = [_task(i, "zero") for i in range(3)]
    back, comp = [], []
    for k in range(3):
        back.append(_task(3 + 2 * k, "zero"))
        comp.append(_task(4 + 2 * k, "compute"))
    reduces = [_task(9 + k, "dp", [comp[min(k, 2)].id]) for k in range(4)]
    nxt = _task(13, "zero")
    anchors = [None, *comp[:2]]  # the compute last in the stream when A_k was built
    one_communicator([(g, True, None) for g in fwd]
                     + [(g, False, a) for g, a in zip(back, anchors, strict=True)]
                     + [(nxt, True, comp[-1])], reduces, comp, ahead)
    order = fwd + back[:ahead + 1]
    for k, r in enumerate(reduces):
        order += [r] + ([back[k + ahead + 1]] if k + ahead + 1 < 3 else [])
    order.append(nxt)
    for before, task in itertools.pairwise(order):
        cross = [before.id] if before.stream != task.stream else []
        assert task.deps == [*([comp[min(reduces.index(task), 2)].id]
                               if task in reduces else []), *cross], task.name


def fsdp1(layers: int, m: int, nodes: int = 2, prefetch: int = 1, **over: Any) -> Scenario:
    """A small GPT under Composer's FSDP1 (layer units, fp32 reduce-scatters) over
    ``nodes`` nodes of two GPUs."""
    return scenario_from_dict({
        "name": "fsdp1-communicator",
        "model": {"layers": layers, "hidden": 1024, "heads": 8, "vocab": 4096,
                  "seq_len": 512},
        "cluster": {"system": "dgx-h100", "nodes": nodes, "gpus_per_node": 2},
        "parallel": {"dp": 2 * nodes, "zero": 3, "fsdp_prefetch": prefetch, **over},
        "training": {"global_batch": 2 * nodes * m, "micro_batch": 1},
        "stack": "composer-fsdp1",
    })


def _comm_spans(s: Scenario) -> pd.DataFrame:
    _, spans = simulate_scenario(s)
    assert spans is not None
    r0 = spans[(spans["rank"] == 0)
               & spans["op"].isin(["zero.all_gather", "dp.reduce_scatter"])]
    return r0.sort_values(["start", "task"]).reset_index(drop=True)


def expected_order(layers: int, m: int, ahead: int) -> list[str]:
    """FSDP's issue order of one rank's collectives: per micro-batch the root's gather
    and L forward gathers, then the backward's first ``ahead`` + 1 gathers and its L + 1
    reduce-scatters, each followed by the gather ``ahead`` + 1 units on."""
    order: list[str] = []
    for _ in range(m):
        order += ["AG"] * (1 + layers) + ["AG"] * min(ahead + 1, layers)
        for k in range(layers + 1):
            order += ["RS"] + (["AG"] if k + ahead + 1 < layers else [])
    return order


@settings(max_examples=8, deadline=None)
@given(layers=st.integers(2, 4), m=st.integers(1, 3), prefetch=st.sampled_from([1, 2]))
def test_engine_runs_one_collective_at_a_time_in_fsdp_order(layers: int, m: int,
                                                            prefetch: int) -> None:
    """On the engine's timeline rank 0's gathers and reduce-scatters over its shard group
    never overlap, and start in FSDP's issue order."""
    spans = _comm_spans(fsdp1(layers, m, prefetch=prefetch))
    starts, ends = spans["start"].to_numpy(), spans["end"].to_numpy()
    assert (starts[1:] >= ends[:-1] - 1e-12).all()
    seq = ["AG" if op.endswith("all_gather") else "RS" for op in spans["op"]]
    assert seq == expected_order(layers, m, prefetch)


def test_expected_order_of_one_unit_ahead() -> None:
    assert expected_order(3, 1, 1) == ["AG"] * 4 + ["AG", "AG", "RS", "AG", "RS", "RS",
                                                    "RS"]


@settings(max_examples=10, deadline=None)
@given(layers=st.integers(2, 6), m=st.integers(1, 4), nodes=st.sampled_from([2, 4, 8]),
       hidden=st.sampled_from([512, 2048]))
def test_closed_form_never_hides_more_than_before(layers: int, m: int, nodes: int,
                                                   hidden: int) -> None:
    """The serialised communicator only adds: the closed form's ZeRO-3 time with it is at
    least the one without (each layer's gather and reduce-scatter behind its backward,
    the next micro-batch's gathers after the last reduce-scatters), by at least
    (m − 1) × (a layer's reduce-scatter + the root's)."""
    s = scenario_from_dict({**_data(layers, m, nodes), "model": {
        "layers": layers, "hidden": hidden, "heads": 8, "vocab": 4096, "seq_len": 512}})
    with_serial = simulate_scenario(s, "analytic")[0]
    r, root = z3.serial_reductions(s, _layout(s), s.hardware)
    assert r > 0 and root > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(z3, "serial_reductions", lambda *a: (0.0, 0.0))
        without = simulate_scenario(s, "analytic")[0]
    assert with_serial["step_time_s"] >= without["step_time_s"] + (m - 1) * (r + root) - 1e-12


def _data(layers: int, m: int, nodes: int) -> dict[str, Any]:
    return {"name": "fsdp1-communicator",
            "cluster": {"system": "dgx-h100", "nodes": nodes, "gpus_per_node": 2},
            "parallel": {"dp": 2 * nodes, "zero": 3},
            "training": {"global_batch": 2 * nodes * m, "micro_batch": 1},
            "stack": "composer-fsdp1"}


def _layout(s: Scenario):  # type: ignore[no-untyped-def]
    from simulator.builder.workload import layout_of
    return layout_of(s)


def test_module_units_keep_their_streams() -> None:
    """DeepSpeed's module units (several gathers a layer, reduce-scatters by bucket) are
    not reordered: the closed form has no serial term for them."""
    s = scenario_from_dict({**_data(2, 2, 2), "model": {
        "layers": 2, "hidden": 512, "heads": 8, "vocab": 4096, "seq_len": 512},
        "stack": "deepspeed"})
    assert z3.serial_reductions(s, _layout(s), s.hardware) == (0.0, 0.0)


@pytest.mark.parametrize(("layers", "m", "nodes"), [(2, 1, 2), (3, 2, 2), (4, 3, 4),
                                                    (2, 3, 4)])
def test_engine_step_never_shorter_in_one_communicator(layers: int, m: int,
                                                       nodes: int) -> None:
    """Ordering a communicator's collectives only adds waits: the engine's step is at
    least as long as with the gathers and reduce-scatters side by side. (Where
    micro-batches follow one another the next one's gathers come after the backward's
    last reduce-scatters either way: the compute stream that issues them waits for those
    after every backward, tests/test_zero3_reduce_wait.py.)"""
    from simulator.strategies.zero3 import workload

    s = fsdp1(layers, m, nodes)
    serial = simulate_scenario(s)[0]["step_time_s"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workload, "one_communicator", lambda *a: None)
        side_by_side = simulate_scenario(s)[0]["step_time_s"]
    assert serial >= side_by_side - 1e-12

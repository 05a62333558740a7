"""ZeRO-3 with module units (``stack.zero3_unit: module``, DeepSpeed): one all-gather per
linear module sized by its weight (:func:`simulator.model.inventory.sharding.zero3_blocks`), each
block's gathered one block ahead (DeepSpeed's coordinator prefetches the next
parameters in trace order under ``stage3_max_live_parameters``, about one block at
GPT-3's sizes), and a block's own gathers gating only that block. The closed form: in
a forward whose MLP gathers outlast the attention block before them, the MLP waits
exactly their excess."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.model import transformer as mdl
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import zero3_blocks
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.spec.stack import StackSpec, load_stack


def _z3(unit: str = "module", recompute: str = "none", bandwidth: float | None = None,
        **stack: Any) -> Scenario:
    cluster: dict[str, Any] = {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8}
    if bandwidth is not None:
        cluster["intra_node_bandwidth_GBps"] = bandwidth
    return scenario_from_dict({
        "name": "z3-modules", "stack": {"preset": "deepspeed", "zero3_unit": unit, **stack},
        "model": {"layers": 4, "hidden": 2048, "heads": 16, "vocab": 8192, "seq_len": 1024},
        "cluster": cluster,
        "parallel": {"dp": 8, "zero": 3, "recompute": recompute},
        "training": {"global_batch": 16, "micro_batch": 1}})


def test_module_gathers_are_the_weights_and_add_up_to_the_layer() -> None:
    s = _z3()
    layer = mdl.layer_params(s.model)
    blocks = zero3_blocks(s.model, s.stack, 1, layer)
    assert [len(v) for v in blocks.values()] == [2, 2]  # QKV, out-proj; up, down
    assert sum(sum(v) for v in blocks.values()) == pytest.approx(layer)
    # a GPT block: QKV 3h², out-proj h², up 4h², down 4h² (biases and norms pro rata)
    assert [e / blocks["attn"][1] for e in (*blocks["attn"], *blocks["mlp"])] == \
        pytest.approx([3, 1, 4, 4])
    unfused = StackSpec.model_validate({"preset": "deepspeed", "fusions": []})
    assert len(zero3_blocks(s.model, unfused, 1, layer)["attn"]) == 4  # q, k, v, out-proj
    fsdp = zero3_blocks(s.model, load_stack("pytorch-eager"), 1, layer)
    assert fsdp == {"attn": (layer,)}


def _stream(s: Scenario, name: str) -> list[Any]:
    return build_workload(s).programs[0].streams[name]


def test_each_block_gathers_one_block_ahead_and_waits_for_its_own() -> None:
    compute, zero = _stream(_z3(), "compute"), _stream(_z3(), "zero")
    by_id = {t.id: t for t in (*compute, *zero)}
    ends = {t.name: t for t in compute}
    for layer in (2, 3):
        mlp = [t for t in zero if t.name.startswith(f"zero3.all_gather L{layer} part 3/4 mb1")]
        attn = [t for t in zero if t.name.startswith(f"zero3.all_gather L{layer} part 1/4 mb1")]
        # forward (the first of each): after the block two back
        assert by_id[mlp[0].deps[0]] is ends[f"fwd.mlp L{layer - 1} mb1"]
        assert by_id[attn[0].deps[0]] is ends[f"fwd.attn L{layer - 1} mb1"]
        wait = next(t for t in compute if t.name == f"zero3.wait L{layer} mlp mb1")
        last = next(t for t in zero if t.name.startswith(f"zero3.all_gather L{layer} part 4/4 mb1"))
        assert wait.deps == [last.id] and wait.duration == 0
        assert compute[compute.index(wait) + 1].name == f"fwd.mlp L{layer} mb1"


@pytest.mark.parametrize(("recompute", "first"), [("none", "mlp"), ("full", "attn")])
def test_a_backward_gathers_in_the_order_its_blocks_run(recompute: str, first: str) -> None:
    """Without recomputation the MLP's backward comes first; with full recomputation the
    recomputed attention does, and its MLP's gathers wait at the recomputed MLP."""
    zero = _stream(_z3(recompute=recompute), "zero")
    backward = [t for t in zero if t.name.endswith("mb0") and " L1 " in t.name][4:]
    parts = [t.name.split(" part ")[1].split()[0] for t in backward]
    assert parts == (["3/4", "4/4", "1/4", "2/4"] if first == "mlp"
                     else ["1/4", "2/4", "3/4", "4/4"])


def test_the_mlp_waits_exactly_what_its_gathers_outlast_the_attention() -> None:
    """A slow link: the MLP block's two gathers (8h² weights) outlast the attention block
    they overlap, and the forward's MLP starts when the last of them ends."""
    s = _z3(bandwidth=40.0)
    _, spans = simulate_scenario(s)
    assert spans is not None
    g = spans[spans["rank"] == 0].sort_values("start")

    def span(name: str) -> pd.Series:  # the first: the forward's
        return g[g["name"] == name].iloc[0]

    for layer in (2, 3):
        attn, mlp = span(f"fwd.attn L{layer} mb1"), span(f"fwd.mlp L{layer} mb1")
        gathers = [span(f"zero3.all_gather L{layer} part {p}/4 mb1") for p in (3, 4)]
        took = sum(x["end"] - x["start"] for x in gathers)
        assert gathers[0]["start"] == pytest.approx(attn["start"])  # one block ahead
        assert took > attn["end"] - attn["start"]  # the case this test is about
        assert mlp["start"] - attn["end"] == pytest.approx(
            took - (attn["end"] - attn["start"]), rel=1e-6)


def test_module_units_expose_more_than_layer_units_on_a_slow_link() -> None:
    """A window of one block hides less than a window of one layer (the engine)."""
    from simulator.analysis.uncertainty import step_time_of

    module = step_time_of(_z3("module", bandwidth=40.0), "engine", None)
    assert module > step_time_of(_z3("layer", bandwidth=40.0), "engine", None)


@pytest.mark.parametrize(("prefetch", "overlap", "blocks"), [
    (1, True, ("attn", "mlp")), (2, True, ("mlp", "attn", "mlp")), (1, False, ("mlp",))])
def test_the_memory_model_holds_the_blocks_the_engine_gathers(
        prefetch: int, overlap: bool, blocks: tuple[str, ...]) -> None:
    """Closed form: with module units the gathered parameters are the running block and
    the fsdp_prefetch blocks after it (attention and MLP alternate; the largest window,
    here one starting at an MLP), or without prefetch the larger block alone; against
    layer units' 1 + prefetch layers, the unsharded gradient and the root the same."""
    from simulator.analysis.memory import peak_memory

    def buffers(unit: str) -> float:
        s = scenario_from_dict({**_z3(unit).model_dump(mode="json", exclude={"hardware"}),
                                "parallel": {"dp": 8, "zero": 3, "fsdp_prefetch": prefetch,
                                             "overlap": {"zero3_prefetch": overlap}}})
        return peak_memory(s).comm_buffers

    s = _z3()
    layer = mdl.layer_params(s.model) * dtype_bytes(s.training.dtype)
    parts = {b: sum(w) for b, w in zero3_blocks(s.model, s.stack, 1, layer).items()}
    gathered_layers = 1 + (prefetch if overlap else 0)
    assert buffers("layer") - buffers("module") == pytest.approx(
        gathered_layers * layer - sum(parts[b] for b in blocks), rel=1e-9)

"""The scenario contract: keys that must work, and errors that teach."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import ScenarioError
from simulator.spec.load import scenario_from_dict
from simulator.spec.rules import scenario_warnings
from simulator.spec.scenario import Scenario

CONTRACT: dict[str, Any] = {
    "name": "gpt3-175b-1024",
    "model": {"layers": 96, "hidden": 12288, "heads": 96, "kv_heads": 96,
              "ffn_hidden": 49152, "vocab": 51200, "seq_len": 2048},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 128, "gpus_per_node": 8,
                "intra_node_bandwidth_GBps": 300, "inter_node_bandwidth_GBps": 25,
                "link_latency_us": 2.0},
    "parallel": {"tp": 8, "pp": 16, "dp": 8, "schedule": "1f1b", "virtual_stages": 1,
                 "zero": 0, "recompute": "none", "sequence_parallel": False},
    "training": {"global_batch": 1536, "micro_batch": 1, "dtype": "bf16"},
}


def with_(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(CONTRACT)
    for path, value in changes.items():
        node = d
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return d


def errors(d: dict[str, Any]) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(d)
    return info.value.lines()


def test_contract_keys_load() -> None:
    s = scenario_from_dict(CONTRACT)
    assert s.microbatches == 192
    assert s.hardware.intra_node.bandwidth_GBps == 300
    assert s.hardware.inter_node.bandwidth_GBps == 25
    assert s.hardware.intra_node.latency_us == 2.0


def test_preset_with_overrides_and_defaults() -> None:
    s = scenario_from_dict(with_(model={"preset": "llama2-70b", "seq_len": 2048}))
    assert (s.model.layers, s.model.kv, s.model.ffn, s.model.seq_len) == (80, 8, 28672, 2048)
    g = scenario_from_dict(with_(model={"preset": "gpt3-175b", "hidden": 6144, "heads": 48}))
    assert g.model.ffn == 4 * 6144 and g.model.kv == 48


def test_unknown_key_suggests_closest() -> None:
    (line,) = errors(with_(parallel__tpp=8))
    assert line.startswith("parallel.tpp = 8:") and "did you mean 'tp'" in line


def test_wrong_type_and_non_positive() -> None:
    lines = errors(with_(model__layers="many", training__micro_batch=0))
    assert any(x.startswith("model.layers = 'many'") and "whole number" in x for x in lines)
    assert any(x.startswith("training.micro_batch = 0") and "> 0" in x for x in lines)


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"cluster__nodes": 64}, "parallel", "tp(8) * cp(1) * pp(16) * dp(8) = 1024"),
    ({"parallel__tp": 5, "cluster__nodes": 80}, "parallel.tp", "not divisible by tp"),
    ({"parallel__pp": 64, "parallel__dp": 2}, "model.layers", "pp(64) * virtual_stages(1)"),
    ({"training__global_batch": 1540}, "training.global_batch", "multiple of 8"),
    ({"parallel__schedule": "interleaved", "parallel__virtual_stages": 2,
      "training__global_batch": 8 * 24}, "training.global_batch", "multiple of pp(16)"),
    ({"parallel__virtual_stages": 2}, "parallel.virtual_stages", "only with schedule"),
    ({"parallel__schedule": "interleaved", "training__global_batch": 1540},
     "parallel.virtual_stages", "interleaved needs virtual_stages >= 2"),
    ({"model__kv_heads": 7}, "model.kv_heads", "must divide"),
    ({"cluster__system": "dgx-a100"}, "cluster.system", "not a preset"),
    ({"parallel__schedule": "pipedream"}, "parallel.schedule", "must be one of"),
])
def test_each_rule_names_field_value_and_fix(changes: dict[str, Any], field: str,
                                             words: str) -> None:
    lines = errors(with_(**changes))
    assert any(x.startswith(f"{field} = ") and words in x for x in lines), lines


def test_several_problems_listed_together() -> None:
    lines = errors(with_(parallel__tp=5, training__global_batch=1540, model__layerz=3))
    assert len(lines) == 1  # unknown key fails field validation before cross-field rules
    lines = errors(with_(parallel__tp=5, training__global_batch=1540))
    assert len(lines) >= 3  # world size, heads % tp, batch divisibility


def test_tp_larger_than_node_warns() -> None:
    s = scenario_from_dict(with_(parallel__tp=16, parallel__dp=4))
    assert any("larger than an NVLink domain" in w for w in scenario_warnings(s))


def test_frozen() -> None:
    s = scenario_from_dict(CONTRACT)
    with pytest.raises(Exception):  # noqa: B017 (pydantic's frozen error)
        s.parallel.tp = 2  # type: ignore[misc]


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                      st.text(max_size=8), st.sampled_from(["1f1b", "gpipe", "bf16", "full"]))


def mutate() -> st.SearchStrategy[dict[str, Any]]:
    sections = ["model", "cluster", "parallel", "training", "simulation", "bogus"]
    keys = ["layers", "tp", "pp", "dp", "nodes", "system", "schedule", "zero", "heads",
            "global_batch", "micro_batch", "dtype", "preset", "virtual_stages", "kv_heads",
            "overlap", "fidelity", "x"]
    return st.dictionaries(st.tuples(st.sampled_from(sections), st.sampled_from(keys)),
                           st.one_of(json_leaf, st.dictionaries(st.text(max_size=3), json_leaf,
                                                                max_size=2)), max_size=4)


@settings(max_examples=300, deadline=None)
@given(mutate(), st.booleans())
def test_fuzz_gives_scenario_or_one_line_errors(changes: dict[Any, Any], drop: bool) -> None:
    d = copy.deepcopy(CONTRACT)
    for (section, key), value in changes.items():
        if not isinstance(d.get(section), dict):
            d[section] = {}
        d[section][key] = value
    if drop:
        d.pop("training")
    try:
        s = scenario_from_dict(d)
    except ScenarioError as exc:
        assert exc.lines() and all("\n" not in line and line for line in exc.lines())
    else:
        assert isinstance(s, Scenario)


@settings(max_examples=100, deadline=None)
@given(st.one_of(json_leaf, st.lists(json_leaf, max_size=3),
                 st.dictionaries(st.text(max_size=5), json_leaf, max_size=4)))
def test_fuzz_any_document(doc: Any) -> None:
    try:
        scenario_from_dict(doc)
    except ScenarioError as exc:
        assert all("\n" not in line for line in exc.lines())


def test_absurd_numbers_are_errors_not_hangs() -> None:
    """Found by the fuzz: 1e300 heads once made the divisor hint loop for ever."""
    lines = errors(with_(model__heads=1e300, cluster__intra_node_bandwidth_GBps=float("inf"),
                         parallel__tp=10**12))
    assert any(x.startswith("model.heads = 1e+300") for x in lines)
    assert any(x.startswith("cluster.intra_node_bandwidth_GBps = inf") for x in lines)
    assert any(x.startswith("parallel.tp = 1000000000000") and "<=" in x for x in lines)
    prime = errors(with_(model__heads=999_999_937))  # a large prime: the hint stays quick
    assert any("use one of 1, 999999937" in x for x in prime)

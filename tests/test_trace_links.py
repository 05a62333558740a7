"""trace.json's flows and counters on real runs: every flow's ends pair up and bind to the
right spans, rank selections, memory and link-utilisation counters."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from simulator.api import Run, run_scenario
from simulator.errors import UserError
from simulator.outputs.rank_selection import parse_rank_selection, select_ranks
from simulator.outputs.trace_export import to_chrome_trace
from simulator.spec.load import scenario_from_dict

SMALL = {
    "name": "small", "model": {"preset": "tiny-gpt"},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 2, "gpus_per_node": 4},
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "schedule": "1f1b"},
    "training": {"global_batch": 16, "micro_batch": 2, "dtype": "bf16"},
}


@pytest.fixture(scope="module")
def full_run() -> Run:
    return run_scenario(scenario_from_dict(SMALL), fidelity="full", trace_ranks="all")


def test_links_read_no_per_collective_dict() -> None:
    """The traced ranks' link load reads transfer starts from the result's array: the
    cached dict of every collective of every rank (1.7 GB at 16,384 GPUs) stays unmade."""
    from simulator.builder.workload import build_workload
    from simulator.engine.engine import simulate
    from simulator.outputs.span_table import span_table
    from simulator.outputs.trace_links import trace_links

    s = scenario_from_dict(SMALL)
    result = simulate(build_workload(s, fidelity="full"), s.hardware)
    links = trace_links(s, result, span_table(result), [0])
    assert len(links.links) and "comm_start" not in vars(result)


def trace_of(run: Run) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = to_chrome_trace(run.spans, run.results,
                                                   run.trace)["traceEvents"]
    return events


def enclosing(events: list[dict[str, Any]], flow: dict[str, Any]) -> dict[str, Any]:
    """The one complete event on the flow event's thread whose interval holds it."""
    found = [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) ==
             (flow["pid"], flow["tid"]) and e["ts"] <= flow["ts"] <= e["ts"] + e["dur"]]
    assert len(found) == 1, (flow, found)
    return found[0]


def test_every_flow_start_has_its_finish_bound_to_the_right_spans(full_run: Run) -> None:
    events = trace_of(full_run)
    ends: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            assert e["ph"] not in ends[e["id"]], f"flow {e['id']} has two {e['ph']}"
            ends[e["id"]][e["ph"]] = e
    assert ends and all(set(pair) == {"s", "f"} for pair in ends.values())
    kinds = defaultdict(int)
    for pair in ends.values():
        s, f = pair["s"], pair["f"]
        assert (s["cat"], s["name"]) == (f["cat"], f["name"]) and f["bp"] == "e"
        assert s["ts"] <= f["ts"]
        src, dst = enclosing(events, s), enclosing(events, f)
        kinds[s["name"]] += 1
        if s["name"] == "pp":  # a send, to the compute on another rank that waited for it
            assert src["name"] == "pp.send" and dst["tid"] == 0 and dst["pid"] != src["pid"]
            assert dst["ts"] >= src["ts"] + src["dur"] - 1e-3
            assert dst["args"]["microbatch"] == src["args"]["microbatch"]
        else:  # one collective: same op, overlapping, the source arrived last
            assert src["name"] == dst["name"] and src["cat"] == dst["cat"] == s["name"]
            assert src["pid"] != dst["pid"] and src["ts"] >= dst["ts"]
    # 1F1B, 4 micro-batches: per DP×TP pipeline (4) 4 activations and 4 gradients
    assert kinds["pp"] == 4 * (4 + 4)
    assert kinds["tp"] > 0 and kinds["dp"] > 0


def test_collective_members_share_one_flow_per_waiting_member(full_run: Run) -> None:
    spans = full_run.spans
    assert spans is not None and full_run.trace is not None
    flows = full_run.trace.flows
    tp = flows[flows["cat"] == "tp"]
    # every TP collective has 2 members: one flow (2 endpoints) each
    n_tp = (spans["kind"] == "tp").sum()
    assert len(tp) == n_tp


def test_rank_selection_stages_list_and_errors() -> None:
    s = scenario_from_dict(SMALL)
    run = run_scenario(s, fidelity="full", trace_ranks=(0, 1))
    events = trace_of(run)
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["name"] for e in events if e["ph"] == "s"}
    assert names == {"tp"}  # ranks 0 and 1 are TP peers; their pipeline peers are absent
    default = run_scenario(s, fidelity="full")
    assert default.trace is not None and default.trace.ranks == [0, 4]
    assert select_ranks("stages", [4, 5, 6, 7, 1, 2], 4) == [1, 4]
    assert parse_rank_selection(" 5,0,5 ") == (5, 0)
    for bad in ("", "a", "-1", "1,,2"):
        with pytest.raises(UserError, match="use all, stages, or ranks"):
            parse_rank_selection(bad)
    with pytest.raises(UserError, match=r"rank\(s\) 9 not simulated"):
        run_scenario(s, fidelity="full", trace_ranks=(0, 9))


def test_counters_per_rank(full_run: Run) -> None:
    events = trace_of(full_run)
    counters = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            assert len(e["args"]) == 1
            counters[e["pid"], e["name"], next(iter(e["args"]))].append(e)
    ranks = range(8)
    assert {k for k in counters if k[1] == "memory"} == {(r, "memory", "allocated_GB")
                                                         for r in ranks}
    for r in ranks:  # TP and DP stay in a node (4 GPUs), pipeline transfers cross nodes
        assert (r, "link", "intra_node") in counters
        assert (r, "link", "inter_node") in counters
    peak = max(e["args"]["allocated_GB"] for e in counters[0, "memory", "allocated_GB"])
    curve = next(c for c in full_run.results["memory_timeline"] if c["rank"] == 0)
    assert peak == pytest.approx(max(v for _, v in curve["points"]) / 1e9)
    for key, series in counters.items():
        ts = [e["ts"] for e in series]
        assert ts == sorted(ts) and ts[0] == 0.0, key
        if key[1] == "link":
            values = [e["args"][key[2]] for e in series]
            assert min(values) == 0.0 and max(values) > 0 and values[-1] == 0.0

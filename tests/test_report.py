"""Report figures defined by nccl-tests: algbw and busbw of the simulated collectives."""

from __future__ import annotations

import pytest

from simulator.api import simulate_scenario
from simulator.scenario import scenario_from_dict


def test_tp_all_reduce_busbw_is_the_link_rate() -> None:
    """A ring all-reduce alone on NVLink: busbw = algbw × 2(n−1)/n equals the link's
    achievable rate once latency is negligible (α = 0 here)."""
    s = scenario_from_dict({
        "name": "busbw", "model": {"preset": "tiny-gpt", "hidden": 1024, "heads": 8},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "link_latency_us": 0},
        "parallel": {"tp": 8, "pp": 1, "dp": 1},
        "training": {"global_batch": 2, "micro_batch": 2},
        "simulation": {"collective_algorithm": "ring"},
    })
    results, _ = simulate_scenario(s)
    ar = results["collectives"]["tp.all_reduce"]
    # two per layer and pass, plus the embedding, output-layer and three loss reductions
    assert ar["count"] == 2 * 2 * s.model.layers + 5
    link = s.hardware.intra_node.bytes_per_s / 1e9
    assert ar["busbw_GBps"] == pytest.approx(link, rel=1e-9)
    assert ar["algbw_GBps"] == pytest.approx(link * 8 / (2 * 7), rel=1e-9)


def test_pipeline_idle_counts_tp_as_busy() -> None:
    """The bubble fraction counts TP collectives as idle (they are not compute); the
    pipeline idle fraction counts them busy, so it is smaller by exactly their share,
    and with free communication the two agree."""
    base = {
        "name": "idle", "model": {"preset": "tiny-gpt", "layers": 8},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1},
        "parallel": {"tp": 2, "pp": 4, "dp": 1, "schedule": "1f1b"},
        "training": {"global_batch": 8, "micro_batch": 1},
    }
    results, spans = simulate_scenario(scenario_from_dict(base))
    assert results["pipeline_idle_fraction"] < results["bubble_fraction"]
    p0, p1 = results["pipeline_phase_s"]
    tp = spans[spans["kind"] == "tp"]
    share = (tp["end"] - tp["start"]).sum() / (4 * (p1 - p0))
    assert results["bubble_fraction"] - results["pipeline_idle_fraction"] == pytest.approx(
        share, rel=1e-9)
    free = {**base, "cluster": {**base["cluster"], "intra_node_bandwidth_GBps": 1e12,
                                "link_latency_us": 0}}
    results, _ = simulate_scenario(scenario_from_dict(free))
    assert results["pipeline_idle_fraction"] == pytest.approx(results["bubble_fraction"],
                                                              abs=1e-6)

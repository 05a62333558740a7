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
    assert ar["count"] == 2 * 2 * s.model.layers
    link = s.hardware.intra_node.bytes_per_s / 1e9
    assert ar["busbw_GBps"] == pytest.approx(link, rel=1e-9)
    assert ar["algbw_GBps"] == pytest.approx(link * 8 / (2 * 7), rel=1e-9)

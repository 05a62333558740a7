"""Report figures defined by nccl-tests: algbw and busbw of the simulated collectives."""

from __future__ import annotations

import pytest

from simulator.api import simulate_scenario
from simulator.spec.load import scenario_from_dict


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


def test_collectives_report_nccls_algorithm_and_protocol() -> None:
    """auto: every TP all-reduce counted under the algorithm/protocol NCCL's tuner takes
    for its size (tiny activations on 8 GPUs: a ring in LL)."""
    s = scenario_from_dict({
        "name": "protocols", "model": {"preset": "tiny-gpt", "heads": 8},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1},
        "parallel": {"tp": 8, "pp": 1, "dp": 1},
        "training": {"global_batch": 2, "micro_batch": 1},
    })
    results, _ = simulate_scenario(s)
    ar = results["collectives"]["tp.all_reduce"]
    assert ar["algorithms"] == {"ring/LL": ar["count"]}


def test_tp_communication_is_its_own_category_not_bubble() -> None:
    """TP collectives on the compute stream are time of the pass they sit in: the
    breakdown shows them as ``tp_transfer`` (one simulated member per group when
    folded: no peer-wait), and the bubble stays the schedule's, (p − 1)/(m + p − 1)
    up to the stages' imbalance (the embedding and the head)."""
    p, m = 4, 8
    s = scenario_from_dict({
        "name": "tp-busy", "model": {"preset": "tiny-gpt", "layers": 16, "vocab": 512},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1},
        "parallel": {"tp": 2, "pp": p, "dp": 1, "schedule": "1f1b"},
        "training": {"global_batch": m, "micro_batch": 1},
    })
    results, spans = simulate_scenario(s)
    tp = spans[(spans["kind"] == "tp") & (spans["stream"] == "compute")]
    per_rank = (tp["end"] - tp["start"]).groupby(tp["rank"]).sum()
    mean = results["step_breakdown_s"]
    assert mean["tp_transfer"] == pytest.approx(per_rank.mean(), rel=1e-9)
    assert mean["tp_wait"] == 0.0
    assert results["bubble_fraction"] <= (p - 1) / (m + p - 1) * (1 + 1e-9)
    assert results["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1), rel=0.1)

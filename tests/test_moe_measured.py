"""The measured MoE run (calibration/measured/moe_worker.py): its layer against a dense
reference, its configuration checks and the scenario it writes for `compare`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibration.measured.measure_config import make_config
from calibration.measured.measure_launch import torchrun_command
from calibration.measured.measure_scenario import scenario_dict
from simulator.api import simulate_scenario
from simulator.spec.load import scenario_from_dict

torch = pytest.importorskip("torch")


def _layer(experts: int, top_k: int, capacity: float):  # type: ignore[no-untyped-def]
    from calibration.measured.gpt import GPTConfig
    from calibration.measured.moe_worker import MoEMLP

    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, hidden=16, heads=2, ffn_hidden=32, vocab=64, seq_len=8)
    return MoEMLP(cfg, experts, top_k, capacity, ep=1, group=None)


def _reference(layer, x):  # type: ignore[no-untyped-def]
    """Every token through its top-k experts, weighted by renormalised probabilities."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(layer.router(tokens), dim=-1)
    gate, idx = probs.topk(layer.top_k, dim=-1)
    gate = gate / gate.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(layer.top_k):
            out[t] += gate[t, j] * layer.expert(tokens[t:t + 1], int(idx[t, j]))[0]
    return out.view_as(x)


def test_moe_layer_equals_the_dense_reference_when_nothing_is_dropped() -> None:
    layer = _layer(experts=4, top_k=2, capacity=2.0)  # c = E/k: every expert can take all
    x = torch.randn(2, 8, 16, requires_grad=True)
    got = layer(x)
    assert torch.allclose(got, _reference(layer, x), atol=1e-6)
    got.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


def test_capacity_drops_what_overflows_and_keeps_the_buffers_fixed() -> None:
    layer = _layer(experts=4, top_k=2, capacity=0.25)
    assert layer.capacity(16) == 2  # ⌈0.25 · 2 · 16 / 4⌉
    x = torch.randn(2, 8, 16)
    full = _reference(layer, x)
    got = layer(x)
    dropped = (got - full).abs().sum(-1) > 1e-6
    assert dropped.any() and torch.isfinite(got).all()


def test_configuration_checks() -> None:
    cfg = make_config(tp=1, pp=1, dp=2, experts=4, ep=2, model="tiny-gpt")
    assert "calibration.measured.moe_worker" in torchrun_command(cfg, Path("c.json"))
    dense = make_config(tp=1, pp=1, dp=2, model="tiny-gpt")
    assert "calibration.measured.parallel_worker" in torchrun_command(dense, Path("c.json"))
    for kwargs, text in [({"tp": 2, "dp": 1, "ep": 1}, "use tp 1, pp 1"),
                         ({"tp": 1, "dp": 2, "ep": 3}, "ep=3: must divide dp (2)"),
                         ({"tp": 1, "dp": 2, "ep": 2, "experts": 0}, "needs experts >= 2")]:
        args = {"pp": 1, "model": "tiny-gpt", "experts": 4, **kwargs}
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            make_config(**args)


def test_scenario_of_a_moe_run_is_simulated_with_expert_parallelism(tmp_path: Path) -> None:
    cfg = make_config(tp=1, pp=1, dp=2, experts=4, ep=2, model="tiny-gpt", out_dir=tmp_path)
    d = scenario_dict(cfg)
    s = scenario_from_dict(json.loads(json.dumps(d)))
    assert (s.model.experts, s.model.experts_per_token, s.model.capacity_factor) == (4, 2, 1.0)
    assert (s.parallel.ep, s.parallel.edp) == (2, 1)
    results, _ = simulate_scenario(s, "engine", "full")
    assert results["collectives"]["ep.all_to_all"]["count"] == 2 * 4 * 4 * 4  # ranks·layers·mb·4
    assert results["step_breakdown_s"]["ep_transfer"] > 0
    # the worker's one flat all-reduce of the dense gradients after the backward (no DDP)
    assert (s.stack.grad_reduce, s.stack.ddp_first_bucket_MB) == ("after_backward", 0)
    assert results["collectives"]["dp.all_reduce"]["count"] == 2  # one per rank
    assert not s.stack.overlap(s.parallel.overlap).dp


@pytest.mark.slow
def test_measured_moe_run_and_its_comparison(tmp_path: Path) -> None:
    """A real two-process run (gloo): it trains, and its state bytes are the memory
    model's exactly."""
    from calibration.measured.compare import run_compare
    from calibration.measured.measure import run_measure

    measured = run_measure(1, 1, 2, experts=4, ep=2, model="tiny-gpt", steps=2, warmup=1,
                           out_dir=str(tmp_path), timeout_s=300)
    assert measured["step_time_s"] > 0 and measured["experts"] == 4
    comparison = run_compare(tmp_path, "cpu-1thread", plot=False)
    assert comparison["relative_error"]["state_bytes"] == pytest.approx(0.0, abs=1e-9)

"""Gradient compression (training.gradient_compression): closed forms of the bytes on
the wire, the engine's collectives against them, engine against analytic, memory
deltas, the warm-up step and the validation errors."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from simulator.analysis.accounting.vocabulary import CATEGORIES
from simulator.analysis.memory import memory_report
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.errors import ScenarioError
from simulator.model import transformer as mdl
from simulator.model.memory import stage_params
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.compression import arithmetic as cmp

GPT = {"layers": 4, "hidden": 128, "heads": 4, "ffn_hidden": 512, "vocab": 512,
       "seq_len": 64}
SLOW = {"inter_node_bandwidth_GBps": 0.5, "intra_node_bandwidth_GBps": 2.0}


def make(method: str = "none", *, dp: int = 4, pp: int = 1, tp: int = 1, m: int = 2,
         dtype: str = "bf16", model: dict[str, Any] | None = None,
         system: str = "dgx-a100-80gb", gpn: int = 2, cluster: dict[str, Any] | None = None,
         compression: dict[str, Any] | None = None, **parallel: Any) -> Scenario:
    world = dp * pp * tp
    return scenario_from_dict({
        "name": "compression",
        "model": model or GPT,
        "cluster": {"system": system, "nodes": max(world // gpn, 1),
                    "gpus_per_node": min(gpn, world), **(cluster or {})},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1, "dtype": dtype,
                     "gradient_compression": {"method": method, **(compression or {})}},
        # PyTorch's DDP hooks and DeepSpeed's 1-bit Adam on 16-bit gradients; no host cost
        # per kernel (the small model would be launch-bound, which test_stack.py covers)
        "stack": {"preset": "pytorch-eager", "host_overhead_us": 0.0},
    })


def hand_powersgd(spec: dict[str, int], r: int) -> tuple[int, int]:
    """(compressed elements, uncompressed elements) of a tied GPT with biases and
    LayerNorm, pp = 1, min_compression_rate 2, counted by hand."""
    h, f, v, s, layers = (spec["hidden"], spec["ffn_hidden"], spec["vocab"], spec["seq_len"],
                          spec["layers"])
    matrices = [(h, h)] * 4 + [(f, h), (h, f)]
    per_layer = sum(r * (n + m) for n, m in matrices)
    vectors = 4 * h + f + h + 4 * h  # biases of q, k, v, out, up, down; two LayerNorms
    embed = r * (v + h) + r * (s + h)
    return layers * per_layer + embed, layers * vectors + 2 * h


# ================================================================ closed forms


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_powersgd_bytes_are_r_times_n_plus_m_in_fp32(rank: int) -> None:
    s = make("powersgd", compression={"rank": rank})
    t = cmp.traffic(s)
    row = t["per_stage"][0]  # type: ignore[index]
    compressed, vectors = hand_powersgd(GPT, rank)
    assert row["reduced_bytes"] == 4 * (compressed + vectors)
    psi = mdl.param_count(s.model)
    assert row["uncompressed_reduced_bytes"] == 2 * psi  # n·m·2 (bf16) plus the vectors
    assert t["wire_bytes_per_gpu"] == pytest.approx(2 * 3 / 4 * 4 * (compressed + vectors))


def test_powersgd_leaves_small_matrices_uncompressed() -> None:
    """(n + m)·r·2 >= n·m: a 8×8 matrix at rank 4 is all-reduced as it is."""
    b = cmp.powersgd_bucket([(8, 8), (64, 64), (100, 1)], rank=4, min_rate=2)
    assert b.matrices == ((64, 64, 4),)
    assert (b.uncompressed, b.p, b.q, b.elements) == (64 + 100, 256, 256, 64 + 4096 + 100)


@pytest.mark.parametrize(("dtype", "method", "ratio"),
                         [("fp32", "bf16", 0.5), ("fp32", "fp8", 0.25), ("bf16", "fp8", 0.5)])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_low_precision_wire_scales_the_bytes(dtype: str, method: str, ratio: float,
                                             zero: int) -> None:
    t = cmp.traffic(make(method, dtype=dtype, zero=zero))
    assert t["wire_bytes_per_gpu"] == pytest.approx(ratio * t["uncompressed_wire_bytes_per_gpu"])
    assert t["saved_fraction"] == pytest.approx(1 - ratio)


def test_onebit_adam_bytes() -> None:
    """Phase 1 all-to-all of N/8 bytes of signs, phase 2 all-gather of N/8; each with
    an all-gather of one fp32 scale per rank: 2(n-1)/n · N/8 + 2 (n-1)/n · 4n."""
    n = 4
    s = make("onebit_adam", dp=n)
    psi = mdl.param_count(s.model)
    t = cmp.traffic(s)
    assert t["wire_bytes_per_gpu"] == pytest.approx(2 * (n - 1) / n * (psi / 8 + 4 * n))
    assert t["uncompressed_wire_bytes_per_gpu"] == pytest.approx(2 * (n - 1) / n * 2 * psi)


@pytest.mark.parametrize("model", [GPT, {**GPT, "tied_embeddings": False},
                                   {**GPT, "activation": "swiglu", "norm": "rmsnorm",
                                    "bias": False, "position": "rope", "kv_heads": 2}])
@pytest.mark.parametrize("pp", [1, 2])
def test_tensor_shapes_add_up_to_the_stage_parameters(model: dict[str, Any], pp: int) -> None:
    s = make(dp=2, pp=pp, model=model)
    for stage in range(pp):
        assert cmp.stage_elements(s, stage) == stage_params(s.model, pp, stage)


# ================================================================ engine


def dp_collective_bytes(spans: pd.DataFrame, rank: int) -> float:
    mine = spans[(spans["rank"] == rank) & (spans["kind"] == "dp")]
    return float(mine[~mine["name"].str.contains("updated params")]["bytes"].sum())


@pytest.mark.parametrize(("method", "zero"), [("powersgd", 0), ("onebit_adam", 0),
                                              ("bf16", 0), ("fp8", 2), ("none", 0)])
@pytest.mark.parametrize("pp", [1, 2])
def test_engine_reduces_the_closed_form_bytes(method: str, zero: int, pp: int) -> None:
    s = make(method, dtype="fp32", pp=pp, zero=zero, dp_bucket_MB=0.05)
    results, spans = simulate_scenario(s)
    assert spans is not None
    for row in cmp.traffic(s)["per_stage"]:  # type: ignore[attr-defined]
        rank = int(spans[spans["stage"] == row["stage"]]["rank"].min())
        assert dp_collective_bytes(spans, rank) == pytest.approx(row["reduced_bytes"])
    assert results["gradient_compression"]["method"] == method


# Where the uncompressed analytic step matches the engine (pure DP; with PP or TP on
# these slow links the analytic method's neglect of contention already differs 5-25%)
@pytest.mark.parametrize("extra", [
    {"schedule": "interleaved", "virtual_stages": 2, "m": 4, "model": {**GPT, "layers": 8}},
    {"layers_per_stage": [1, 3]},
])
def test_engine_bytes_with_chunks_and_uneven_stages(extra: dict[str, Any]) -> None:
    s = make("powersgd", dtype="fp32", pp=2, dp_bucket_MB=0.05, **extra)
    _, spans = simulate_scenario(s)
    assert spans is not None
    for row in cmp.traffic(s)["per_stage"]:  # type: ignore[attr-defined]
        rank = int(spans[spans["stage"] == row["stage"]]["rank"].min())
        assert dp_collective_bytes(spans, rank) == pytest.approx(row["reduced_bytes"])


CASES = [
    ("powersgd", {}, "dgx-a100-80gb", 0.03),
    ("powersgd", {"m": 8, "dp_bucket_MB": 0.05}, "dgx-a100-80gb", 0.03),
    ("onebit_adam", {}, "dgx-a100-80gb", 0.03),
    ("bf16", {"dtype": "fp32"}, "dgx-a100-80gb", 0.03),
    # ZeRO-2 reduces after every micro-batch; on this communication-bound toy step (the
    # reductions 90% of it) the estimate, which spreads a micro-batch's compressed chains
    # evenly over its backward, exposes 0.14 ms more of them than the engine: 3.9%
    ("fp8", {"zero": 2}, "dgx-a100-80gb", 0.05),
    ("powersgd", {}, "cpu-1thread", 0.03),
    ("onebit_adam", {}, "cpu-1thread", 0.03),
    ("fp8", {}, "cpu-1thread", 0.03),
]


@pytest.mark.parametrize(("method", "extra", "system", "rel"), CASES)
def test_engine_and_analytic_agree(method: str, extra: dict[str, Any], system: str,
                                   rel: float) -> None:
    s = make(method, system=system, cluster=SLOW if system != "cpu-1thread" else None,
             **extra)
    engine, _ = simulate_scenario(s, method="engine")
    analytic, _ = simulate_scenario(s, method="analytic")
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=rel)
    for results in (engine, analytic):
        for entry in results["time_breakdown_s"]:
            assert sum(entry[c] for c in CATEGORIES) == pytest.approx(
                results["step_time_s"], rel=1e-9, abs=1e-12)
        assert sum(results["critical_path_s"].values() if results.get("critical_path_s")
                   else [results["step_time_s"]]) == pytest.approx(results["step_time_s"])


@pytest.mark.parametrize(("method", "extra"), [("powersgd", {"pp": 2}),
                                              ("onebit_adam", {"pp": 2}),
                                              ("onebit_adam", {"tp": 2, "dp": 2})])
def test_breakdowns_sum_with_pp_and_tp(method: str, extra: dict[str, Any]) -> None:
    plain, _ = simulate_scenario(make(cluster=SLOW, **extra))
    for how in ("engine", "analytic"):
        results, _ = simulate_scenario(make(method, cluster=SLOW, **extra), method=how)
        assert results["step_time_s"] < plain["step_time_s"]
        for entry in results["time_breakdown_s"]:
            assert sum(entry[c] for c in CATEGORIES) == pytest.approx(
                results["step_time_s"], rel=1e-9, abs=1e-12)


def test_compression_compute_is_optimizer_time_and_saves_wire_time() -> None:
    """On a slow network PowerSGD shortens the step; its kernels show as optimizer time
    (also when they run on the dp stream and the step waits for them)."""
    plain, _ = simulate_scenario(make(cluster=SLOW))
    psgd, _ = simulate_scenario(make("powersgd", cluster=SLOW, dp_bucket_MB=1000))
    assert psgd["step_time_s"] < plain["step_time_s"]
    assert psgd["step_breakdown_s"]["dp_transfer"] < plain["step_breakdown_s"]["dp_transfer"]
    assert psgd["step_breakdown_s"]["optimizer"] > plain["step_breakdown_s"]["optimizer"]
    assert psgd["step_breakdown_s"]["imbalance_idle"] == pytest.approx(0, abs=1e-12)


def test_warm_up_step_is_the_uncompressed_step() -> None:
    plain, _ = simulate_scenario(make(cluster=SLOW))
    for method, key in (("powersgd", "start_step"), ("onebit_adam", "freeze_step")):
        warm = make(method, cluster=SLOW, compression={key: 10, "step": 9})
        after = make(method, cluster=SLOW, compression={key: 10, "step": 10})
        assert not cmp.compressed_step(warm) and cmp.compressed_step(after)
        results, _ = simulate_scenario(warm)
        assert results["step_time_s"] == plain["step_time_s"]
        assert results["gradient_compression"]["saved_fraction"] == 0


# ================================================================ memory


def test_memory_deltas() -> None:
    base = memory_report(make(dtype="fp32", dp_bucket_MB=1000))[0]
    psgd_s = make("powersgd", dtype="fp32", dp_bucket_MB=1000)
    psgd = memory_report(psgd_s)[0]
    psi = mdl.param_count(psgd_s.model)
    compressed, _ = hand_powersgd(GPT, 4)
    # error buffer + P and Q + the copy of the one bucket in flight, fp32
    assert psgd.comm_buffers - base.comm_buffers == pytest.approx(
        4 * (psi + compressed + psi))
    base = memory_report(make(dtype="fp32"))[0]
    assert (psgd.optimizer, psgd.weights) == (base.optimizer, base.weights)
    onebit = memory_report(make("onebit_adam", dtype="fp32", dp=4))[0]
    assert onebit.optimizer - base.optimizer == pytest.approx(4 * psi * (1 + 1 / 4))
    # 1-bit Adam allocates its errors at the first step; PowerSGD at its first compressed one
    warm = make("onebit_adam", dtype="fp32", compression={"freeze_step": 5, "step": 0})
    assert memory_report(warm)[0].optimizer == onebit.optimizer
    warm = make("powersgd", dtype="fp32", compression={"start_step": 5, "step": 0})
    assert memory_report(warm)[0].total == base.total
    base = memory_report(make(dtype="fp32", dp_bucket_MB=1000))[0]
    fp8 = memory_report(make("fp8", dtype="fp32", dp_bucket_MB=1000))[0]
    assert fp8.comm_buffers - base.comm_buffers == pytest.approx(1 * psi)


# ================================================================ validation


@pytest.mark.parametrize(("overrides", "field", "text"), [
    ({"zero": 1}, "training.gradient_compression.method", "use parallel.zero: 0"),
    ({"tp": 2, "dp": 2}, "training.gradient_compression.method", "use parallel.tp: 1"),
    ({"compression": {"start_step": 1}}, "training.gradient_compression.start_step",
     "must be >= 2"),
    ({"compression": {"freeze_step": 5}}, "training.gradient_compression.freeze_step",
     "only for method onebit_adam"),
])
def test_powersgd_refusals(overrides: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(ScenarioError) as err:
        make("powersgd", **overrides)
    assert any(p.field == field and text in p.fix for p in err.value.problems)


def test_other_refusals() -> None:
    with pytest.raises(ScenarioError, match="1bit-Adam is not compatible with ZeRO"):
        make("onebit_adam", zero=3)
    with pytest.raises(ScenarioError, match="only for powersgd and onebit_adam"):
        make("bf16", compression={"step": 3})
    with pytest.raises(ScenarioError, match="only for method powersgd"):
        make("onebit_adam", compression={"rank": 2})
    with pytest.raises(ScenarioError, match="dense models only"):
        make("fp8", model={"preset": "mixtral-8x7b"})
    make("bf16", zero=3, tp=2, dp=2)  # a wire format works with any sharding


def test_cli_one_line_error(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: x\nmodel: {preset: tiny-gpt}\n"
                    "cluster: {system: dgx-a100-80gb, nodes: 1, gpus_per_node: 2}\n"
                    "parallel: {dp: 2, zero: 3}\n"
                    "training: {global_batch: 4, gradient_compression: {method: onebit_adam}}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: training.gradient_compression.method")


def test_gpt2_slow_network_pair() -> None:
    """The bundled pair: PowerSGD sends ~1% of DDP's bytes and shortens the step by
    removing the exposed all-reduce, at the cost of its fp32 error buffer."""
    from pathlib import Path

    from simulator.spec.load import load_scenario

    root = Path(__file__).resolve().parent.parent / "scenarios"
    ddp, psgd = (load_scenario(root / f"gpt2-xl-16gpu-slow-net-{v}.yaml")
                 for v in ("ddp", "powersgd"))
    a, _ = simulate_scenario(ddp)
    b, _ = simulate_scenario(psgd)
    assert b["gradient_compression"]["saved_fraction"] > 0.98
    assert b["step_time_s"] < a["step_time_s"] - 0.5 * a["step_breakdown_s"]["dp_transfer"]
    delta = memory_report(psgd)[0].total - memory_report(ddp)[0].total
    assert delta == pytest.approx(4 * mdl.param_count(psgd.model), rel=0.05)

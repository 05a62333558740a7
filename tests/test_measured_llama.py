"""The measured runs' Llama block (``clustersim measure --model tiny-llama | llama-1b``):
RMSNorm, SwiGLU, rotary positions and grouped-query attention in
calibration/measured/llama.py, the scenario it writes, its validation, and the peak
reserved memory ``clustersim compare`` sets beside the simulation.

The launches are torchruns of two one-thread CPU processes on a tiny model (gloo).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.measured import llama
from calibration.measured.compare import measured_figures, relative_errors, table_lines
from calibration.measured.gpt import GPT, GPTConfig
from calibration.measured.gpt_presets import LLAMA_1B
from calibration.measured.measure import make_config, run_measure, scenario_yaml
from calibration.measured.measure_scenario import scenario_dict
from simulator.model.transformer import param_count
from simulator.spec.load import load_scenario

TINY = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64, "vocab": 64,
        "seq_len": 16, "arch": "llama"}
RUN: dict[str, Any] = {"micro_batches": 2, "model": TINY, "steps": 2, "warmup": 1,
                       "device": "cpu"}


# --------------------------------------------------------------------------- the block
@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 30), n=st.integers(0, 30), shift=st.integers(0, 30))
def test_rotary_scores_depend_only_on_the_offset(m: int, n: int, shift: int) -> None:
    """RoPE's defining property: a query at m and a key at n score as at m+s and n+s
    (to the float32 precision the tables are computed in, as the model uses them)."""
    gen = torch.Generator().manual_seed(m * 97 + n)
    q, k = torch.randn(16, generator=gen, dtype=torch.float64), \
        torch.randn(16, generator=gen, dtype=torch.float64)
    cos, sin = (t.double() for t in llama.rotary_tables(64, 16))

    def score(i: int, j: int) -> float:
        qi = llama.apply_rotary(q.view(1, 1, 1, 16), cos[i], sin[i])
        kj = llama.apply_rotary(k.view(1, 1, 1, 16), cos[j], sin[j])
        return float((qi * kj).sum())

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-5, abs=1e-5)


def test_rotary_keeps_norms_and_position_zero() -> None:
    x = torch.randn(2, 3, 8, 16, dtype=torch.float64)
    cos, sin = (t.double() for t in llama.rotary_tables(8, 16))
    y = llama.apply_rotary(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # angle 0: cos 1, sin 0


def test_grouped_query_attention_is_attention_over_repeated_heads() -> None:
    q = torch.randn(2, 8, 10, 4)
    k, v = torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                          v.repeat_interleave(4, 1), is_causal=True)
    assert torch.allclose(llama.attend(q, k, v), want, atol=1e-6)


GPT_TINY = {k: v for k, v in TINY.items() if k not in ("arch", "kv_heads")}


@pytest.mark.parametrize("sizes", [TINY, {**TINY, "kv_heads": 4}, GPT_TINY])
def test_parameters_are_what_the_simulator_counts(sizes: dict[str, Any]) -> None:
    """The model built and the scenario it writes hold the same parameters (GQA's narrow
    k and v, SwiGLU's three matrices, no biases, no position table, a tied head)."""
    cfg = make_config(tp=1, pp=1, dp=1, **{**RUN, "model": sizes})
    model = GPT(GPTConfig.from_dict(cfg.model))
    built = sum(p.numel() for p in model.parameters())
    scenario = load_scenario_text(scenario_yaml(cfg, "cpu"))
    assert built == param_count(scenario.model)


def load_scenario_text(text: str) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "scenario.yaml"
        path.write_text(text)
        return load_scenario(path)


def test_llama_1b_preset_is_llama_3_2_1b() -> None:
    """1.24B parameters (Meta's model card: 1.23B), tied embeddings."""
    model = GPT(GPTConfig.from_dict({**LLAMA_1B, "layers": 1}))
    per_layer = sum(p.numel() for p in model.layers.parameters())
    total = per_layer * 16 + sum(p.numel() for n, p in model.named_parameters()
                                 if not n.startswith("layers."))
    assert total == pytest.approx(1.236e9, rel=1e-3)


def test_scenario_says_llama_features() -> None:
    cfg = make_config(tp=2, pp=1, dp=1, sequence_parallel=True, **RUN)
    model = scenario_dict(cfg, "cpu")["model"]
    assert isinstance(model, dict)
    assert {k: model[k] for k in ("activation", "norm", "bias", "position", "kv_heads")} == {
        "activation": "swiglu", "norm": "rmsnorm", "bias": False, "position": "rope",
        "kv_heads": 2}


@pytest.mark.parametrize(("change", "words"), [
    ({"model": {**TINY, "kv_heads": 3}}, "model.kv_heads=3: must divide heads=4"),
    ({"model": {**TINY, "arch": "gpt"}}, "grouped-query attention needs arch llama"),
    ({"model": {**TINY, "arch": "mamba"}}, "model.arch='mamba': choose one of gpt, llama"),
    ({"model": {**TINY, "kv_heads": 1}, "tp": 2}, "model.kv_heads=1: not divisible by tp=2"),
    ({"cp": 2, "dp": 1}, "the MoE and context-parallel runs build GPT-2's blocks"),
])
def test_bad_llama_configs_are_one_line_errors(change: dict[str, Any], words: str) -> None:
    args = {"tp": 1, "pp": 1, "dp": 1, **RUN, **change}
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        make_config(**args)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- compare
def test_peak_reserved_is_compared_where_measured_and_na_on_cpu() -> None:
    base = {"step_time_s": 1.0, "per_rank": [{"compute_s": 0.5, "optimizer_s": 0.1,
                                              "profiled_step_s": 1.0}], "device": "cuda",
            "state_bytes": [10]}
    sim = {"step_time_s": 1.0, "compute_s": 0.5, "non_compute_s": 0.4, "idle_fraction": 0.4,
           "state_bytes": 10.0, "peak_reserved_bytes": 3e9}
    on_gpu = measured_figures({**base, "peak_reserved_bytes": [2e9, 2.5e9]})
    assert on_gpu["peak_reserved_bytes"] == 2.5e9
    assert relative_errors(on_gpu, sim)["peak_reserved_bytes"] == pytest.approx(0.2)
    on_cpu = measured_figures({**base, "device": "cpu", "peak_reserved_bytes": [None]})
    assert relative_errors(on_cpu, sim)["peak_reserved_bytes"] is None
    lines = table_lines({"measured": on_cpu, "simulated": sim,
                         "relative_error": relative_errors(on_cpu, sim)})
    assert lines[-1].split()[:2] == ["peak_reserved_bytes", "n/a"]


# --------------------------------------------------------------------------- launches
def test_fsdp2_llama_runs_and_its_state_is_simulated(tmp_path: Path) -> None:
    """Two ranks of FSDP2 on the Llama block end to end: finite losses, no reserved
    figure on CPU, and the parameter state the simulation holds, byte for byte."""
    from calibration.measured.compare import compare

    result = run_measure(tp=1, pp=1, dp=2, zero=3, **RUN, out_dir=tmp_path, timeout_s=180)
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["peak_reserved_bytes"] == [None, None]
    comparison = compare(tmp_path, "cpu-1thread")
    assert comparison["relative_error"]["state_bytes"] == pytest.approx(0.0, abs=1e-9)
    assert comparison["scenario"]["model"]["activation"] == "swiglu"


@pytest.mark.slow
def test_llama_layouts_compute_the_same_losses(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Same seed and data: TP with SP (GQA heads split), PP and one-rank FSDP2 train the
    identical Llama model."""
    layouts = [{"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": True},
               {"tp": 1, "pp": 2, "dp": 1},
               {"tp": 1, "pp": 1, "dp": 1, "zero": 3}]
    losses = [run_measure(**lay, **RUN, out_dir=tmp_path_factory.mktemp("l"),
                          timeout_s=180)["losses"] for lay in layouts]
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-5)

"""Calibration of GEMM efficiency by shape: the sweep times the shapes the op inventory
prices (a scenario's own with ``calibrate --scenario``), and the fit divides each
measured shape's quantisation out, so a calibrated profile prices the measured shapes
at their measured times. All on CPU with synthetic records."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from calibration.microbench.bench_shapes import (
    GemmShape,
    inventory_gemms,
    model_gemm_shapes,
    scenario_gemm_shapes,
)
from calibration.microbench.bench_timing import budget_for
from calibration.microbench.fit_profile import fit_compute, well_quantised
from calibration.microbench.profile_build import build_profile
from simulator.cli.main import main as cli
from simulator.model.inventory.dense import dense_layer_ops
from simulator.model.inventory.ops import gemm
from simulator.spec.load import load_scenario
from simulator.spec.model_spec import load_preset_model
from simulator.spec.stack import default_stack
from simulator.system.costs import CostModel
from simulator.system.gemm_shape import GemmCall
from simulator.system.profiles import load_system, validate_profile

ROOT = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"


def test_the_sweep_times_the_inventory_s_own_calls() -> None:
    """llama3-8b at TP 2, one sequence: the forward linears the inventory prices, each
    2·m·n·k = its op's lookup FLOPs; the closed forms of the table in bench_shapes."""
    mdl = load_preset_model("llama3-8b")
    shapes = {name: (m, n, k) for name, m, n, k in inventory_gemms(mdl, 2, 1)}
    ops = {op.name: op for op in dense_layer_ops(mdl, 1, 2, False, "bf16", "fwd",
                                                 default_stack()) if op.kind == "gemm"}
    T, h, d = mdl.seq_len, mdl.hidden, mdl.head_size
    for name, op in ops.items():
        m, n, k = shapes[name]
        assert 2.0 * m * n * k == op.gemm_flops
    assert shapes["out_proj"] == (T, h, mdl.heads // 2 * d)
    assert shapes["mlp_down"] == (T, h, mdl.ffn // 2)
    assert shapes["logits"] == (T, mdl.vocab // 2, h)
    qkv = (mdl.heads // 2 + 2 * mdl.kv // 2) * d
    assert shapes["qkv"] == (T, qkv // ops["qkv"].kernels, h)


def test_a_scenario_s_gemms_are_all_timed() -> None:
    """``calibrate --scenario``: every GEMM of that scenario's model at its TP degree and
    micro-batch joins the sweep, none thinned out by the spread over sizes."""
    path = str(ROOT / "scenarios" / "llama2-70b-128xh100.yaml")
    budget = budget_for("cuda", "full")
    own = scenario_gemm_shapes(path, budget)
    s = load_scenario(path)
    want = {(m, n, k) for _, m, n, k in inventory_gemms(s.model, s.parallel.tp,
                                                        s.training.micro_batch, s.stack)}
    assert {(g.m, g.n, g.k) for g in own} == want and want
    plan = model_gemm_shapes(replace(budget, scenario_gemms=own), "cuda")
    assert want <= {(g.m, g.n, g.k) for g in plan}


def _record(i: int, m: int, n: int, k: int, seconds: float, layout: str = "") -> dict[str, Any]:
    kind = "gemm_layout" if layout else "gemm"
    return {"key": f"cuda/bf16/t1/{kind}/{layout}{i}", "kind": kind, "ok": True,
            "device": "cuda", "dtype": "bf16", "threads": 1, "m": m, "n": n, "k": k,
            "flops": 2.0 * m * n * k, "time_s": seconds, **({"layout": layout} if layout else {})}


#: forward shapes: whole waves and badly quantised ones of similar FLOPs, square small ones
SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (256 * 12, 128 * 11, 4096),
          (256 * 14, 128 * 10, 4096), (4096, 768, 4096), (8192, 8192, 8192),
          (4096 + 8, 4096, 4096), (16384, 1536, 8192)]


def _measured(eff: float) -> list[dict[str, Any]]:
    """What an H100 whose GEMMs reach ``eff`` of the datasheet times their shape factor
    would read (the model the cost model prices)."""
    gpu = load_system("dgx-h100").gpu
    out = []
    for i, (m, n, k) in enumerate(SHAPES):
        f = gpu.gemm_shape_factor(GemmCall(m, n, k))
        out.append(_record(i, m, n, k, 2.0 * m * n * k / (989e12 * eff * f)))
    return out


def test_the_fit_divides_the_shape_out_and_the_profile_multiplies_it_back() -> None:
    """Synthetic H100 GEMMs at 0.6 of the datasheet times their quantisation: the fitted
    curve is flat at 0.6 (not dragged down by the badly quantised shapes), the profile
    carries the preset's tiles and reduction-depth curve, and it prices every measured shape
    at its measured time."""
    records = _measured(0.6)
    fits = fit_compute(records, "cuda", "bf16", 1, H100)
    assert fits.gemm is not None and fits.gemm_tiles == load_system("dgx-h100").gpu.gemm_tiles
    assert all(e == pytest.approx(0.6, rel=1e-6) for _, e in fits.gemm.points)
    prof = build_profile(fits, load_system("dgx-h100"), name="x", device="cuda",
                         device_name=H100, gpus_per_node=8, memory_GB=None, provenance={},
                         datasheet=True)
    hw = validate_profile(prof, "x.yaml")
    assert hw.gpu.gemm_depth == load_system("dgx-h100").gpu.gemm_depth is not None
    cost = CostModel(hw, "bf16")
    short_k = _record(9, 8192, 8192, 512, 2.0 * 8192 * 8192 * 512 / (
        989e12 * 0.6 * hw.gpu.gemm_shape_factor(GemmCall(8192, 8192, 512))))
    for r in [*records, short_k]:
        op = gemm("x", r["m"], r["k"], r["n"], 2, "gemm_fwd")
        assert cost.op_parts(op)[0] == pytest.approx(r["time_s"], rel=1e-6)


def test_without_tiles_the_records_are_fitted_as_measured() -> None:
    """A GPU no preset describes (no tiles) and a CPU: the times go in unchanged."""
    records = _measured(0.6)
    assert well_quantised(records, None) is records
    cpu = load_system("cpu-1thread")
    assert not cpu.gpu.gemm_tiles and well_quantised(records, cpu) is records
    fits = fit_compute(records, "cuda", "bf16", 1, "Some GPU 9")
    assert fits.gemm_tiles == ()


def test_layout_records_are_quantised_as_their_pass_runs_them() -> None:
    """A dgrad record of X[m×k]·W[k×n] runs an m × k output over n; wgrad k × n over m."""
    sheet = load_system("dgx-h100")
    gpu = sheet.gpu
    m, n, k = 4096, 768, 256 * 14
    rs = [_record(0, m, n, k, 1.0, "dgrad"), _record(1, m, n, k, 1.0, "wgrad")]
    dgrad, wgrad = well_quantised(rs, sheet)
    assert dgrad["time_s"] == gpu.gemm_shape_factor(GemmCall(m, k, n))
    assert wgrad["time_s"] == gpu.gemm_shape_factor(GemmCall(k, n, m))


def test_a_bad_scenario_flag_is_one_line(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["calibrate", "--device", "cpu", "--tiny", "--out", str(tmp_path / "p.yaml"),
              "--scenario", str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--scenario" in err and "no such file" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {preset: llama3-8b}\ntraining: {global_batch: 0}\n")
    rc = cli(["calibrate", "--device", "cpu", "--tiny", "--out", str(tmp_path / "p.yaml"),
              "--scenario", str(bad)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines and all("--scenario" in line and "does not load" in line
                                     for line in lines)


def test_inventory_shapes_match_gemm_shape_records() -> None:
    """The sweep's records carry the inventory's m, n, k (GemmShape), so the fit can
    quantise each one."""
    shapes = model_gemm_shapes(budget_for("cpu", "tiny"), "cpu")
    assert shapes and all(isinstance(s, GemmShape) and s.m >= 8 for s in shapes)

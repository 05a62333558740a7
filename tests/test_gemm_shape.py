"""GEMM efficiency by shape (simulator/system/gemm_shape.py): tile and wave counts worked
by hand, the factor's bounds and monotonicity, the inventory's GEMM ops carrying the
shapes their FLOPs come from, and a profile without tiles pricing exactly as before."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import UserError
from simulator.model.inventory.dense import dense_layer_ops
from simulator.model.inventory.experts import grouped_gemm
from simulator.model.inventory.ops import call_shape, gemm
from simulator.model.transformer import head_ops
from simulator.spec.model_spec import load_preset_model
from simulator.spec.stack import default_stack
from simulator.system.costs import CostModel
from simulator.system.gemm_shape import (
    GemmCall,
    fitted,
    padding,
    quantisation,
    shape_factor,
    tile_count,
    wave_count,
)
from simulator.system.profiles import load_system, validate_profile

H100 = ((256, 128), (128, 256))


def test_tiles_and_waves_worked_by_hand() -> None:
    """2048 × 4608 on 128 × 256 tiles (GPT-3's QKV at TP 8): 16 · 18 = 288 tiles, 3 waves
    of 132 SMs, 288/396 of the slots used; 4097 rows need a 17th tile row; 100 × 100 pads
    one 256 × 128 tile to 10⁴/32768; a grouped launch of 8 experts counts all their tiles."""
    wide = GemmCall(2048, 4608, 12288)
    assert tile_count(wide, (128, 256)) == 288 and wave_count(wide, (128, 256), 132) == 3
    assert quantisation(wide, (128, 256), 132) == pytest.approx(288 / 396)
    assert shape_factor(wide, H100, 132) == pytest.approx(288 / 396)  # 256 × 128: 288 too
    assert shape_factor(wide, H100, 108) == pytest.approx(288 / 324)  # an A100's 108 SMs
    assert tile_count(GemmCall(4097, 768, 2048), (256, 128)) == 17 * 6
    assert padding(GemmCall(4097, 768, 2048), (256, 128)) == pytest.approx(4097 / (17 * 256))
    assert padding(GemmCall(100, 100, 64), (256, 128)) == pytest.approx(1e4 / 32768)
    assert tile_count(GemmCall(512, 256, 64, batch=8), (256, 128)) == 8 * 2 * 2


def test_factor_is_one_at_perfect_tiling() -> None:
    """m, n multiples of the tile and tiles a multiple of the SMs: whole waves, factor 1;
    so is a launch under one wave whose sides are multiples of the tile (4096 × 768: 96
    tiles on 132 SMs; split-K and the FLOPs curve hold what it loses)."""
    call = GemmCall(256 * 12, 128 * 11, 4096)  # 132 tiles on 132 SMs
    assert quantisation(call, (256, 128), 132) == 1.0
    assert shape_factor(call, H100, 132) == 1.0
    assert shape_factor(GemmCall(4096, 768, 2048), H100, 132) == 1.0
    assert shape_factor(GemmCall(1024, 1024, 1024), H100, 132) == 1.0


def test_a_side_shorter_than_the_tile_runs_a_tile_cut_to_it() -> None:
    """A 64-row GEMM runs 64-row tiles (factor 1), a 100 × 100 one a 128 × 128 tile cut
    from 256 × 128 (10⁴/16384), never a half-empty large tile."""
    assert fitted((256, 128), GemmCall(64, 384, 128)) == (64, 128)
    assert fitted((256, 128), GemmCall(100, 100, 64)) == (128, 128)
    assert fitted((256, 128), GemmCall(4096, 768, 64)) == (256, 128)
    assert shape_factor(GemmCall(64, 384, 128), H100, 108) == 1.0
    assert shape_factor(GemmCall(100, 100, 64), H100, 132) == pytest.approx(1e4 / 16384)


def test_badly_quantised_shape_is_slower_than_its_flops() -> None:
    """1.06 waves: 140 tiles of 256 × 128 where 132 fit; both tiles give 140 tiles, two
    waves, 140/264 of the slots; one row more than a tile multiple pads a whole row."""
    call = GemmCall(256 * 14, 128 * 10, 8192)
    assert shape_factor(call, H100, 132) == pytest.approx(140 / 264)
    # 256·11 + 1 rows: 12 tile rows of 256 by 11 of 128, 132 tiles in one full wave, the
    # last row padded (2817/3072); 128 × 256 would take 23 · 6 = 138 tiles, two waves
    assert shape_factor(GemmCall(256 * 11 + 1, 128 * 11, 4096), H100, 132) == \
        pytest.approx(2817 / 3072)


@given(m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 20000),
       batch=st.integers(1, 64), sms=st.integers(1, 200))
@settings(max_examples=300, deadline=None)
def test_factor_never_exceeds_one(m: int, n: int, k: int, batch: int, sms: int) -> None:
    """The term only ever slows a GEMM: factor in (0, 1]; so on a profile the shaped
    efficiency never exceeds the FLOPs-only one."""
    call = GemmCall(m, n, k, batch)
    f = shape_factor(call, H100, sms)
    assert 0 < f <= 1
    gpu = load_system("dgx-h100").gpu
    for cls in ("gemm_fwd", "gemm_dgrad", "gemm_wgrad"):
        assert gpu.efficiency(cls, call.flops, gemm=call) <= gpu.efficiency(cls, call.flops)


@given(m=st.integers(1, 8192), n=st.integers(1, 8192), dm=st.integers(0, 4096),
       sms=st.integers(1, 200))
@settings(max_examples=300, deadline=None)
def test_waves_grow_with_rows_and_fill_within_a_tile(m: int, n: int, dm: int,
                                                      sms: int) -> None:
    """More rows never take fewer tiles or waves; rows added inside the last tile row
    (same tiles, same waves) only raise the quantisation efficiency; padding the rows
    to the tile makes the padding 1 exactly where n is a tile multiple."""
    tile, call, more = (256, 128), GemmCall(m, n, 64), GemmCall(m + dm, n, 64)
    assert tile_count(more, tile) >= tile_count(call, tile)
    assert wave_count(more, tile, sms) >= wave_count(call, tile, sms)
    padded = GemmCall(math.ceil(m / 256) * 256, n, 64)
    assert quantisation(padded, tile, sms) >= quantisation(call, tile, sms)
    assert (padding(GemmCall(padded.m, 128 * math.ceil(n / 128), 64), tile) == 1.0)


@pytest.mark.parametrize("model,tp,fused", [("gpt3-175b", 8, True), ("llama3-8b", 4, False),
                                            ("llama3-8b", 2, True)])
@pytest.mark.parametrize("pass_", ["fwd", "bwd_input", "bwd_weight"])
def test_inventory_gemms_carry_the_shapes_of_their_flops(model: str, tp: int, fused: bool,
                                                         pass_: Any) -> None:
    """Every linear of a layer and the head: 2·m·n·k of its call is its curve's lookup
    FLOPs, the product over its calls is its FLOPs, and the call's output is the pass's
    (forward T × n, dgrad T × k, wgrad k × n)."""
    spec = load_preset_model(model)
    base = default_stack()
    stack = base.model_copy(update={"fusions": tuple(f for f in base.fusions
                                                     if fused or f != "projections")})
    ops = [*dense_layer_ops(spec, 2, tp, True, "bf16", pass_, stack),
           *head_ops(spec, 2, tp, True, "bf16", pass_, stack)]
    gemms = [op for op in ops if op.kind == "gemm" and op.gemm_call is not None]
    assert {op.name for op in gemms} >= {"qkv", "out_proj", "mlp_up", "mlp_down", "logits"}
    tokens = 2 * spec.seq_len
    for op in gemms:
        c = op.gemm_call
        assert c is not None
        assert 2 * c.m * c.n * c.k * c.batch == pytest.approx(op.gemm_flops, rel=1e-12)
        assert op.gemm_flops * op.kernels == pytest.approx(op.flops, rel=1e-12)
        # the tokens are the output's rows forward and dgrad, the reduction in wgrad
        assert (c.k if pass_ == "bwd_weight" else c.m) == tokens
    if not fused:  # separate q, k, v: three calls of a third of the width each
        qkv = next(op for op in gemms if op.name == "qkv")
        assert qkv.kernels == 3


def test_call_shape_by_pass_and_group() -> None:
    """A linear X[T×h]·W[h×f]: forward T × f over h, dgrad T × h over f, wgrad h × f over
    T; three calls split f; 8 grouped experts split T into 8 products of one launch."""
    assert call_shape(4096, 1024, 3072, "fwd") == GemmCall(4096, 3072, 1024)
    assert call_shape(4096, 1024, 3072, "gemm_dgrad") == GemmCall(4096, 1024, 3072)
    assert call_shape(4096, 1024, 3072, "bwd_weight") == GemmCall(1024, 3072, 4096)
    assert call_shape(4096, 1024, 3072, "fwd", 3) == GemmCall(4096, 1024, 1024)
    assert call_shape(4096, 1024, 3072, "fwd", 1, 8) == GemmCall(512, 3072, 1024, 8)
    assert call_shape(4096, 1024, 3072, "fwd", 8, 8) == GemmCall(512, 3072, 1024, 1)
    op = grouped_gemm("expert_up", 4096, 1024, 3072, 8, 2, "gemm_fwd", calls=1)
    assert op.gemm_call == GemmCall(512, 3072, 1024, 8)
    assert op.gemm_call.flops == op.gemm_flops


def _without_tiles(name: str) -> Any:
    data = load_system(name).model_dump(mode="json")
    data["gpu"].pop("gemm_tiles", None)
    data["gpu"].pop("gemm_depth", None)  # no shape term at all
    return validate_profile(data, name)


@pytest.mark.parametrize("name", ["dgx-h100", "dgx-a100-80gb", "cpu-1thread"])
def test_profile_without_tiles_prices_as_before(name: str) -> None:
    """No tiles: a GEMM with its shape costs exactly what it cost by FLOPs alone (the
    same op with the shape stripped), forward and backward."""
    hw = _without_tiles(name)
    cost = CostModel(hw, "bf16" if "bf16" in hw.gpu.peak_tflops else "fp32")
    for cls in ("gemm_fwd", "gemm_dgrad", "gemm_wgrad"):
        for m, k, n in ((4096, 2048, 768), (2048, 12288, 4608), (100, 100, 100)):
            op = gemm("x", m, k, n, 2, cls)
            bare = type(op)(**{**op.__dict__, "gemm_call": None})
            assert cost.op_time(op) == cost.op_time(bare)


def test_tiles_price_a_badly_quantised_gemm_slower() -> None:
    """On the H100 preset the 3584 × 1280 GEMM takes 140 tiles of 256 × 128 (two waves,
    140/264) or 280 of 128 × 128 (three, 280/396): the best, 280/396, of its FLOPs-only
    speed; a whole-wave one runs at its FLOPs' speed."""
    hw = load_system("dgx-h100")
    assert hw.gpu.gemm_tiles == ((256, 128), (128, 256), (128, 128))
    cost = CostModel(hw, "bf16")
    bad = gemm("x", 256 * 14, 8192, 128 * 10, 2, "gemm_fwd")
    good = gemm("x", 256 * 12, 8192, 128 * 11, 2, "gemm_fwd")
    for op, ratio in ((bad, 396 / 280), (good, 1.0)):
        bare = type(op)(**{**op.__dict__, "gemm_call": None})
        assert cost.op_parts(op)[0] == pytest.approx(cost.op_parts(bare)[0] * ratio)


@pytest.mark.parametrize("tiles,why", [
    ([[256, 100]], "multiple of 8"), ([[2048, 128]], "multiple of 8"),
    ([[256.0, 128]], "int"), ([[True, 128]], "int"), ([[256, 128, 64]], "2"),
])
def test_bad_tiles_are_refused(tiles: Any, why: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["gemm_tiles"] = tiles
    with pytest.raises(UserError, match="gemm_tiles"):
        validate_profile(data, "x.yaml")


def test_tiles_need_sms() -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"].pop("sms")
    with pytest.raises(UserError, match="sms"):
        validate_profile(data, "x.yaml")

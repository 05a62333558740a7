"""Multi-token prediction modules (model.mtp_layers): DeepSeek-V3 §2.2 as Megatron-LM builds
them (megatron/core/transformer/multi_token_prediction.py): parameters, FLOPs, the last
stage's time and memory, the analytic estimate against the engine, and the import of
``--mtp-num-layers``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cpu_profile import in_line_scenario
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import make_scenario, run_engine

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.memory import stage_breakdown
from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.cli.main import main
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.memory import stage_params
from simulator.spec.load import load_scenario
from simulator.spec.model_spec import ModelSpec, load_preset_model
from simulator.spec.placement import stage_layers
from simulator.spec.recompute import layer_mode, model_modes

DSV3 = load_preset_model("deepseek-v3")
GPT = {"layers": 4, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}
MOE = {**GPT, "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 64,
       "first_dense_layers": 1, "activation": "swiglu", "norm": "rmsnorm", "bias": False}


def _with(spec: ModelSpec, n: int) -> ModelSpec:
    return ModelSpec.model_validate({**spec.model_dump(), "mtp_layers": n})


# ------------------------------------------------------------------ parameters


def test_module_parameters_in_closed_form() -> None:
    """One module: its layer (of the last layer's kind) + 2h·h projection + three norms
    (enorm, hnorm, final); the embedding and output layer are shared."""
    h = DSV3.hidden
    one = _with(DSV3, 1)
    module = mdl.param_count(one) - mdl.param_count(DSV3)
    assert module == mdl.layer_params(DSV3, DSV3.layers - 1) + 2 * h * h + 3 * h
    assert mdl.param_count(_with(DSV3, 3)) - mdl.param_count(DSV3) == 3 * module


def test_deepseek_v3_module_against_the_release() -> None:
    """README_WEIGHTS.md of deepseek-ai/DeepSeek-V3 gives the MTP module 11.5B unique
    parameters: its transformer layer is 11.51B here (11.61B with the 0.10B projection
    and the norms, which the release's rounding leaves out); the checkpoint on Hugging
    Face holds 685B = 671B of the main model plus 14B of the module, which repeats the
    embedding and the output head (``embed_tokens``, ``shared_head``) besides its unique
    parameters (684.5B here)."""
    assert mdl.layer_params(DSV3, DSV3.layers) == pytest.approx(11.5e9, rel=0.005)
    one = _with(DSV3, 1)
    checkpoint = mdl.param_count(one) + 2 * DSV3.vocab * DSV3.hidden
    assert mdl.param_count(DSV3) == pytest.approx(671e9, rel=0.001)
    assert checkpoint == pytest.approx(685e9, rel=0.001)
    assert checkpoint - mdl.param_count(DSV3) == pytest.approx(14e9, rel=0.05)


def test_the_module_takes_the_last_layers_kind() -> None:
    """Megatron-LM builds the module's layer from the last layer's spec and counts it so
    (training.py ``num_floating_point_operations``: ``last_layer_is_moe``)."""
    one = _with(DSV3, 1)
    assert one.is_moe_layer(DSV3.layers)
    assert moe.layer_kinds(one, 0, one.layers + 1) == [(0, 3), (3, 59)]
    # layers 0, 1, 2 with every second one MoE past the first: 1 is MoE, 2 (the last) is
    # not, so the modules (3 and 4) are dense where the every-k-th rule would make 3 MoE
    dense_last = ModelSpec.model_validate({**MOE, "layers": 3, "moe_layer_freq": 2,
                                           "mtp_layers": 2})
    assert not dense_last.is_moe_layer(3) and not dense_last.is_moe_layer(4)
    assert moe.layer_kinds(dense_last, 0, 5) == [(0, 4), (1, 1)]
    assert moe.layer_kinds(dense_last, 3, 5) == [(3, 2)]


@pytest.mark.parametrize("tied", [True, False])
def test_last_stage_holds_the_module_and_an_embedding_copy(tied: bool) -> None:
    """pp > 1: the module's parameters and, where the stage had none, Megatron's copy of
    the word embedding (``LanguageModule.setup_embeddings_and_output_layer``) on the last
    stage; the other stages unchanged. pp = 1: no copy."""
    s0 = make_scenario(pp=2, model={**GPT, "tied_embeddings": tied})
    s1 = make_scenario(pp=2, model={**GPT, "tied_embeddings": tied, "mtp_layers": 1})
    spec = s0.model

    def held(s: Any, stage: int) -> int:
        return stage_params(s.model, s.parallel.pp, stage,
                            stage_layers(spec.layers, s.parallel, stage, s.model.mtp_layers))
    module = mdl.param_count(s1.model) - mdl.param_count(spec)
    copy = 0 if tied else spec.vocab * spec.hidden
    assert held(s1, 0) == held(s0, 0)
    assert held(s1, 1) - held(s0, 1) == module + copy
    single0, single1 = make_scenario(model={**GPT, "tied_embeddings": tied}), \
        make_scenario(model={**GPT, "tied_embeddings": tied, "mtp_layers": 1})
    assert held(single1, 0) - held(single0, 0) == module


# ------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize("n", [1, 2])
def test_model_flops_in_closed_form(n: int) -> None:
    """A GPT block's module: a layer, 72·B·s·h²·(1 + s/(6h)) (Narayanan et al. SC'21), the
    projection 3 · 2·B·s·2h·h and the logits again 3 · 2·B·s·h·V (Megatron-LM counts the
    same GEMMs; norms are not FLOPs here)."""
    spec = ModelSpec.model_validate({**GPT, "seq_len": 256, "mtp_layers": n})
    base = _with(spec, 0)
    B, s, h, V = 16, spec.seq_len, spec.hidden, spec.vocab
    extra = n * (72 * B * s * h * h * (1 + s / (6 * h)) + 12 * B * s * h * h + 6 * B * s * h * V)
    got = mdl.model_flops_per_step(spec, B) - mdl.model_flops_per_step(base, B)
    assert got == pytest.approx(extra, rel=1e-12)


def test_recomputation_repeats_the_modules_layer() -> None:
    """Hardware FLOPs: the module's layer recomputes as the others do (selective: its
    attention core; full: the layer), and under full recomputation its projection too,
    2·B·s·2h·h (Megatron-LM checkpoints the projection with the layer)."""
    spec = ModelSpec.model_validate({**GPT, "mtp_layers": 1})
    base = _with(spec, 0)
    B, s, h = 4, spec.seq_len, spec.hidden
    for mode, proj in (("selective", 0.0), ("full", 2 * B * s * 2 * h * h)):
        extra = mdl.hardware_flops_per_step(spec, B, mode) - mdl.model_flops_per_step(spec, B)
        base_extra = mdl.hardware_flops_per_step(base, B, mode) \
            - mdl.model_flops_per_step(base, B)
        assert extra == pytest.approx(base_extra * (spec.layers + 1) / spec.layers + proj,
                                      rel=1e-12)


def test_partial_recompute_recomputes_the_module_whole() -> None:
    """Megatron-LM checkpoints each MTP module under full granularity whatever
    --recompute-method and --recompute-num-layers say."""
    s = make_scenario(pp=2, model={**GPT, "mtp_layers": 1},
                      parallel={"recompute": "full", "recompute_num_layers": 1})
    par = s.parallel
    assert layer_mode(par, 4, 4) == "full" and layer_mode(par, 4, 3) == "none"
    full = {r for mode, runs in model_modes(par, 4, 1) if mode == "full" for r in runs}
    assert range(4, 5) in full


# ------------------------------------------------------------------ the engine


def _stage_totals(metrics: dict[str, Any]) -> dict[int, dict[str, float]]:
    keys = ("forward", "backward_input", "backward_weight", "recompute")
    return {e["stage"]: {k: e[k] for k in keys} for e in metrics["time_breakdown_s"]}


def test_modules_add_their_time_and_memory_on_the_last_stage_only() -> None:
    """n modules add n times one module's compute to the last stage and nothing to the
    others; memory grows on the last stage only (one case; the slow test draws more)."""
    _check_last_stage_only(2, 1, "moe", "selective")


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(pp=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2]), kind=st.sampled_from(["gpt",
       "moe"]), recompute=st.sampled_from(["none", "selective", "full"]))
def test_modules_add_their_time_on_the_last_stage_only_drawn(
        pp: int, tp: int, kind: str, recompute: str) -> None:
    _check_last_stage_only(pp, tp, kind, recompute)


def _check_last_stage_only(pp: int, tp: int, kind: str, recompute: str) -> None:
    model = {**(MOE if kind == "moe" else GPT), "layers": 2 * pp}
    extra = {"ep": 2} if kind == "moe" else {}
    runs = {}
    for n in (0, 1, 2):
        s = make_scenario(tp=tp, pp=pp, dp=2, m=2, model={**model, "mtp_layers": n},
                          parallel={"recompute": recompute, **extra})
        runs[n] = (s, _stage_totals(run_engine(s)[0]))
    last = pp - 1
    for n in (1, 2):
        s, stages = runs[n]
        for stage in range(pp):
            base = runs[0][1][stage]
            for key, seconds in stages[stage].items():
                if stage != last:  # the same tasks, summed in another order
                    assert seconds == pytest.approx(base[key], rel=1e-12)
                else:
                    one = runs[1][1][stage][key] - base[key]
                    assert seconds - base[key] == pytest.approx(n * one, rel=1e-9, abs=1e-15)
        assert sum(stages[last].values()) > sum(runs[0][1][last].values())
        for stage in range(pp):
            mem, mem0 = stage_breakdown(s, stage), stage_breakdown(runs[0][0], stage)
            if stage != last:
                assert mem == mem0
            else:
                assert mem.weights > mem0.weights and mem.activations > mem0.activations
                assert mem.logits > mem0.logits


@pytest.mark.parametrize(("sp", "expected"), [
    (False, {("all_gather", 1.0), ("all_reduce", 2.0)}),
    (True, {("all_gather", 2.0), ("all_gather", 1.0), ("reduce_scatter", 2.0)})])
def test_projection_collectives(sp: bool, expected: set[tuple[str, float]]) -> None:
    """Megatron-LM's eh_proj under TP: a column-parallel linear over the b·s·2h
    concatenation whose output is gathered whole (then cut again under SP): forward the
    output's all-gather (and the input's under SP), backward the input gradient's
    all-reduce (reduce-scatter under SP, with the cut's gradient all-gathered); sizes in
    b·s·h activations, per module and micro-batch."""
    s = make_scenario(tp=2, m=2, model={**GPT, "mtp_layers": 1},
                      parallel={"sequence_parallel": sp})
    workload = build_workload(s)
    unit = mdl.tp_comm_bytes_per_layer(s.model, 1, s.training.dtype)
    found = [(t.op.split(".")[-1], t.nbytes / unit) for t in workload.tasks
             if "mtp_proj mb0" in t.name]
    assert set(found) == expected and len(found) == (4 if sp else 2)


@pytest.mark.parametrize("case", [{"pp": 4, "schedule": "1f1b", "m": 8},
                                  {"pp": 4, "schedule": "zb-h1", "m": 8},
                                  {"pp": 1, "dp": 2, "m": 3},
                                  {"tp": 2, "pp": 2, "dp": 2, "zero": 2,
                                   "recompute": "selective", "sequence_parallel": True},
                                  {"tp": 2, "pp": 4, "schedule": "zb-h1", "m": 6,
                                   "recompute": "full", "sequence_parallel": True}],
                         ids=["1f1b", "zb-h1", "single-stage", "tp-sp-zero2", "tp-sp-full"])
def test_memory_timeline_peak_equals_memory_py_with_modules(case: dict[str, Any]) -> None:
    """The allocations over the step (the modules' layers as layers, their ends with the
    output layer's) peak where memory.py's sum says, stage by stage."""
    from test_memory_timeline import MODEL, make, run, stage_peaks, totals

    s = make(model={**MODEL, "mtp_layers": 1}, **case)
    _, timeline = run(s)
    got = stage_peaks(timeline)
    for stage, total in totals(s).items():
        assert got[stage] == pytest.approx(total, rel=1e-12), stage


@pytest.mark.parametrize(("tp", "pp", "dp", "model"), [
    (2, 2, 2, GPT), (1, 2, 4, MOE), (2, 1, 2, GPT)])
def test_folded_equals_full_with_modules(tp: int, pp: int, dp: int, model: dict) -> None:
    extra = {"ep": 2} if model is MOE else {}
    s = make_scenario(tp=tp, pp=pp, dp=dp, m=4, model={**model, "mtp_layers": 1},
                      parallel={"sequence_parallel": tp > 1, **extra})
    folded, _ = run_engine(s, fidelity="folded")
    full, _ = run_engine(s, fidelity="full")
    assert full["step_time_s"] == folded["step_time_s"]


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 2, "sequence_parallel": True},
                                      {"dp": 2}, {"tp": 2, "recompute": "full"}],
                         ids=["tp2", "tp2-sp", "dp2", "tp2-full"])
def test_analytic_prices_the_modules_as_the_engine_runs_them(
        parallel: dict[str, Any], tmp_path: Path) -> None:
    """Communication in line with compute: the estimate prices each module's layer, its
    ends and their TP collectives as the engine issues them, to rounding."""
    s = in_line_scenario(tmp_path, "megatron-core", parallel)
    s = s.model_copy(update={"model": _with(s.model, 2)})
    engine, _ = simulate_scenario(s, "engine")
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=1e-6)
    base = s.model_copy(update={"model": _with(s.model, 0)})
    assert engine["step_time_s"] > simulate_scenario(base, "engine")[0]["step_time_s"]


def test_analytic_close_to_engine_on_a_pipeline() -> None:
    s = make_scenario(tp=2, pp=2, dp=2, m=4, model={**GPT, "mtp_layers": 1},
                      parallel={"sequence_parallel": True})
    engine, _ = run_engine(s)
    assert analytic_estimate(s)["step_time_s"] == pytest.approx(engine["step_time_s"],
                                                                rel=0.01)


# ------------------------------------------------------------------ spec, CLI, import


def test_negative_count_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parent.parent
    rc = main(["run", str(root / "scenarios" / "llama2-7b-8gpu-ddp.yaml"), "--method", "analytic",
               "--set", "model.mtp_layers=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.mtp_layers" in err[0]


def test_megatron_import_maps_the_layers_and_ignores_the_loss_weight(tmp_path: Path) -> None:
    from simulator.imports.megatron import classify

    out = tmp_path / "imported.yaml"
    args = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "2048", "--micro-batch-size", "1", "--vocab-size", "50257",
            "--position-embedding-type", "rope", "--mtp-num-layers", "1",
            "--mtp-loss-scaling-factor", "0.3"]
    assert main(["import", "megatron", "--gpus", "8", "--out", str(out), "--", *args]) == 0
    assert load_scenario(out).model.mtp_layers == 1
    assert classify("--mtp-num-layers")[0] == "mapped"
    assert classify("--mtp-loss-scaling-factor")[0] == "ignored"
    out.unlink()
    assert main(["import", "megatron", "--gpus", "8", "--out", str(out), "--",
                 *args[:-4]]) == 0
    assert load_scenario(out).model.mtp_layers == 0

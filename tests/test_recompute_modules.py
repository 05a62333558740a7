"""Megatron-Core's ``--recompute-modules`` (``parallel.recompute_modules``) and
torchtitan's per-op selective checkpointing (``recompute: op``): which ops each re-runs
and what each layer keeps, pinned to the frameworks' sources
(:mod:`simulator.model.inventory.recompute_policy` cites them).

Oracles, per layer on one rank (T = b·s tokens, L = T/t under sequence parallelism,
dt = 2 bytes, widths per TP rank):

* ``layernorm`` (CheckpointWithoutOutput on both norms) drops the two normed outputs the
  next linears keep, 2·dt·L·h, and re-runs ``ln1`` and ``ln2``;
* ``mlp`` keeps the MLP's input and drops its SwiGLU's inputs and the down-projection's
  input, 3·dt·T·f;
* ``moe_act`` drops the routed activation's output, dt·k·T·f_e; ``shared_experts`` the
  shared MLP's activation and down-projection inputs, 3·dt·T·w; ``moe`` all the MoE
  block keeps but its input: 4·L·E fp32 probabilities, 3·dt·T·w and dt·k·T·(h + 3·f_e);
* ``mla_up_proj`` drops Q, K and V, dt·T·H·(2·d_qk + d_v), and re-runs the up-projections;
* torchtitan's op policy keeps the block input, the outputs of the 1st, 3rd, ... linear
  call, the attention core's output and log-sum-exp (and the reduce-scatters'), and
  re-runs the 2nd, 4th, ... linear call and every other op.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lockstep import _equal

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.analytic.stage import pipeline_time
from simulator.analysis.report import engine_metrics
from simulator.builder.workload import BlockCosts, build_workload
from simulator.cli.main import main
from simulator.engine.engine import simulate
from simulator.errors import ScenarioError
from simulator.model import memory as mem
from simulator.model import transformer as mdl
from simulator.spec.load import scenario_from_dict
from simulator.spec.recompute import flops_modes, module_names, policy
from simulator.spec.scenario import Scenario

DENSE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn_hidden": 512,
         "activation": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
         "vocab": 1024, "seq_len": 128}
MOE = {**DENSE, "experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 128,
       "shared_experts": 1}
MLA = {**MOE, "kv_heads": 8, "mla": {"q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                      "qk_rope_head_dim": 16, "v_head_dim": 32}}
B, DT = 2, 2
T = B * DENSE["seq_len"]
H, F = DENSE["hidden"], DENSE["ffn_hidden"]
MODULES_ORDER = module_names()
FREE = {"intra_node_bandwidth_GBps": 1e12, "inter_node_bandwidth_GBps": 1e12,
        "link_latency_us": 0}


def scenario(model: dict[str, Any] = DENSE, stack: str = "megatron-core", gpus: int = 2,
             free: bool = False, **parallel: Any) -> Scenario:
    return scenario_from_dict({
        "name": "modules", "stack": stack, "model": model,
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": gpus,
                    **(FREE if free else {})},
        "parallel": {"pp": 2, **parallel},
        "training": {"global_batch": 4, "micro_batch": B}})


def kept(s: Scenario, layer: int = 0) -> float:
    par = s.parallel
    return mem.activation_bytes_per_layer(s.model, B, par.tp, par.sequence_parallel,
                                          policy(par), "bf16", layer, stack=s.stack)


def recomputed(s: Scenario, layer: int = 0) -> list[str]:
    par = s.parallel
    return [op.name for op in mdl.layer_recompute_ops(
        s.model, B, par.tp, par.sequence_parallel, "bf16", policy(par), layer, s.stack)]


def modules(*names: str, model: dict[str, Any] = DENSE, **par: Any) -> Scenario:
    return scenario(model, recompute="selective", recompute_modules=list(names), **par)


# ------------------------------------------------------------------ Megatron's modules


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True), (2, False)])
def test_layernorm_drops_the_two_normed_outputs(tp: int, sp: bool) -> None:
    none = scenario(recompute="none", tp=tp, sequence_parallel=sp, gpus=2 * tp)
    s = modules("layernorm", tp=tp, sequence_parallel=sp, gpus=2 * tp)
    local = T / tp if sp else T
    assert kept(none) - kept(s) == pytest.approx(2 * DT * local * H, rel=1e-12)
    assert recomputed(s) == ["ln1", "ln2"]


def test_mlp_keeps_its_input_and_drops_the_rest() -> None:
    s, none = modules("mlp"), scenario(recompute="none")
    assert kept(none) - kept(s) == pytest.approx(3 * DT * T * F, rel=1e-12)
    assert recomputed(s) == ["mlp_up", "act", "mlp_down"]


def test_the_default_module_is_plain_selective() -> None:
    """``[core_attn]`` is Megatron's default: the same policy, figures and tasks as
    ``recompute: selective`` without the field."""
    a, b = modules("core_attn"), scenario(recompute="selective")
    assert policy(a.parallel) == policy(b.parallel) == "selective"
    assert kept(a) == kept(b) and recomputed(a) == recomputed(b) == ["attn_core"]


@pytest.mark.parametrize(("names", "drop", "ops"), [
    (("moe_act",), DT * 2 * T * 128, ["expert_act"]),
    (("shared_experts",), 3 * DT * T * 128, ["shared_up", "shared_act", "shared_down"]),
    (("moe",), 4 * T * 8 + 3 * DT * T * 128 + DT * 2 * T * (H + 3 * 128),
     ["router", "permute", "shared_up", "shared_act", "shared_down", "expert_up",
      "expert_act", "expert_down", "unpermute"]),
    (("mlp",), 0.0, []),  # Megatron: not a MoE layer's (transformer_layer.py)
])
def test_a_moe_layers_modules(names: tuple[str, ...], drop: float, ops: list[str]) -> None:
    s, none = modules(*names, model=MOE), scenario(MOE, recompute="none")
    assert kept(none) - kept(s) == pytest.approx(drop, rel=1e-12)
    assert recomputed(s) == ops


@pytest.mark.parametrize(("names", "drop", "ops"), [
    (("mla_up_proj",), DT * T * 8 * (2 * 48 + 32), ["q_up", "kv_up"]),
    (("layernorm",), 2 * DT * T * H, ["ln1", "ln2"]),
    (("moe_act",), DT * 2 * T * 128, ["expert_act"]),
    (("core_attn",), 0.0, ["attn_core"]),  # a flash core keeps only its inputs
])
def test_a_latent_attention_layers_modules(names: tuple[str, ...], drop: float,
                                           ops: list[str]) -> None:
    s, none = modules(*names, model=MLA), scenario(MLA, recompute="none")
    assert kept(none) - kept(s) == pytest.approx(drop, rel=1e-12)
    assert recomputed(s) == ops


MODELS = {"dense": DENSE, "moe": MOE, "mla": MLA}


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(sorted(MODELS)), chosen=st.sets(st.sampled_from(MODULES_ORDER)),
       added=st.sampled_from(MODULES_ORDER))
def test_a_module_added_never_raises_memory_nor_lowers_step_time(
        kind: str, chosen: set[str], added: str) -> None:
    model = MODELS[kind]
    if model.get("mla") is None:
        chosen.discard("mla_up_proj")
        if added == "mla_up_proj":
            added = "layernorm"
    a, b = modules(*sorted(chosen), model=model), \
        modules(*sorted(chosen | {added}), model=model)
    for layer in range(model["layers"]):
        assert kept(b, layer) <= kept(a, layer) * (1 + 1e-12)
    assert analytic_estimate(b)["step_time_s"] >= analytic_estimate(a)["step_time_s"]
    assert mem.activations(b, 0) <= mem.activations(a, 0) * (1 + 1e-12)


def test_deepseek_v3s_recipe_keeps_the_latents() -> None:
    """DeepSeek-V3 §3.3 recomputes RMSNorm and the MLA up-projections: layernorm +
    mla_up_proj drop both normed inputs and Q, K, V together."""
    both, none = modules("layernorm", "mla_up_proj", model=MLA), scenario(MLA, recompute="none")
    assert kept(none) - kept(both) == pytest.approx(2 * DT * T * H + DT * T * 8 * 128,
                                                    rel=1e-12)


# ------------------------------------------------------------------ torchtitan's op SAC


def _op_kept(q: float, kv: float, f: float, separate: bool) -> float:
    """The block input, the odd linear calls' outputs, the core's output and lse."""
    core = DT * T * q + 4 * T * 8
    calls = [q, kv, kv, H, f, f, H] if separate else [q + 2 * kv, H, 2 * f, H]
    return DT * T * H + core + sum(DT * T * w for w in calls[::2])


@pytest.mark.parametrize(("stack", "separate"), [("torchtitan", True),
                                                 ("megatron-core", False)])
def test_op_keeps_every_other_linear_output(stack: str, separate: bool) -> None:
    s = scenario(stack=stack, recompute="op")
    assert kept(s) == pytest.approx(_op_kept(H, 2 * 32, F, separate), rel=1e-12)
    # re-run: the 2nd, 4th, ... linear call (wk, wo, w3; or out_proj and mlp_down)
    want = 2 * T * H * ((64 + H + F) if separate else (H + F))
    got = mdl.layer_recompute_ops(s.model, B, 1, False, "bf16", "op", 0, s.stack)
    assert sum(op.flops for op in got) == pytest.approx(want, rel=1e-12)
    assert "attn_core" not in [op.name for op in got]
    assert {"ln1", "ln2", "act", "rope"} <= {op.name for op in got}


def test_op_keeps_the_reduce_scatters_under_sequence_parallelism() -> None:
    s = scenario(stack="torchtitan", recompute="op", tp=2, sequence_parallel=True, gpus=4)
    q, kv, f = H / 2, 32.0, F / 2  # per rank: 4 heads, 1 KV head of 32
    local = T / 2
    calls = [q, kv, kv, H, f, f, H]
    want = DT * local * H + DT * T * q + 4 * T * 4 + sum(DT * T * w for w in calls[::2]) \
        + 2 * DT * local * H
    assert kept(s) == pytest.approx(want, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(hidden=st.sampled_from([128, 256, 512]), mult=st.integers(2, 6),
       kv=st.sampled_from([1, 2, 8]), seq=st.sampled_from([64, 128, 256]),
       stack=st.sampled_from(["torchtitan", "megatron-core"]))
def test_op_recomputes_between_selective_and_full(hidden: int, mult: int, kv: int, seq: int,
                                                  stack: str) -> None:
    """Hardware FLOPs: op re-runs at least the core's (selective) and at most the layer
    (full) while s ≤ (h + f)/2, where half the linears outweigh the core (4·T·s·h
    against 2·T·h·(h + f) at least); its memory between full's and none's."""
    model = {**DENSE, "hidden": hidden, "ffn_hidden": mult * hidden, "kv_heads": kv,
             "seq_len": seq}
    if seq > (hidden + mult * hidden) / 2:
        seq = (hidden + mult * hidden) // 2
        model["seq_len"] = seq
    flops = {}
    for mode in ("selective", "op", "full", "none"):
        s = scenario(model, stack, recompute=mode)
        flops[mode] = mdl.hardware_flops_per_step(s.model, 4, policy(s.parallel),
                                                  flops_modes(s.parallel, 4), s.stack)
        flops[mode + "_kept"] = mem.activations(s, 0)
    assert flops["selective"] <= flops["op"] <= flops["full"]
    assert flops["full_kept"] <= flops["op_kept"] <= flops["none_kept"]


# ------------------------------------------------------------------ engine and analytic


@pytest.mark.parametrize("parallel", [
    {"recompute": "op"},
    {"recompute": "selective", "recompute_modules": ["layernorm", "mlp"]}])
def test_engine_and_analytic_agree_when_exact(parallel: dict[str, Any]) -> None:
    """Free communication, balanced blocks: both recompute blocks (the MLP's in a task of
    its own) add to each backward; the schedule's closed form at those times."""
    s = scenario(free=True, **parallel)
    costs = BlockCosts(fwd=(5e-4, 5e-4), bwd_input=(1e-3, 1e-3), bwd_weight=(0.0, 0.0),
                       recompute=(4e-4, 3e-4), embed=(0.0, 0.0, 0.0), head=(0.0, 0.0, 0.0))
    met = engine_metrics(s, simulate(build_workload(s, costs=costs), s.hardware))
    ana = analytic_estimate(s, costs=costs)
    assert ana["step_time_s"] == pytest.approx(met["step_time_s"], rel=1e-9)
    none = analytic_estimate(scenario(free=True), costs=costs)
    m, f, b = s.microbatches, 2e-3, 4e-3  # a stage's 2 layers: F and B per micro-batch
    extra = pipeline_time("1f1b", 2, m, 1, f, b + 2 * 7e-4, 0.0) \
        - pipeline_time("1f1b", 2, m, 1, f, b, 0.0)
    assert ana["step_time_s"] - none["step_time_s"] == pytest.approx(extra, rel=1e-9)


@pytest.mark.parametrize("parallel", [
    {"recompute": "op", "tp": 2, "sequence_parallel": True},
    {"recompute": "selective", "recompute_modules": ["layernorm", "moe_act", "moe"],
     "tp": 2, "ep": 2, "model": MOE}])
def test_folded_full_and_lock_step_agree(parallel: dict[str, Any]) -> None:
    parallel = dict(parallel)
    model = parallel.pop("model", DENSE)
    s = scenario(model, gpus=8, dp=2, **parallel)
    folded = engine_metrics(s, simulate(build_workload(s, fidelity="folded"), s.hardware))
    w = build_workload(s, fidelity="full")
    a, b = simulate(w, s.hardware), simulate(w, s.hardware, lockstep=False)
    assert engine_metrics(s, a)["step_time_s"] == folded["step_time_s"]
    if a.lockstep_groups:  # (none under expert parallelism: every rank its own)
        _equal(s, a, b)
    assert a.end_time == b.end_time


def test_memory_timeline_peak_is_memory_py() -> None:
    from simulator.analysis.memory import stage_breakdown
    from simulator.analysis.memory_timeline import memory_timeline, stage_peaks

    for s in (scenario(stack="torchtitan", recompute="op"), modules("layernorm", "mlp")):
        got = stage_peaks(memory_timeline(s, simulate(build_workload(s), s.hardware)))
        for stage in range(2):
            assert got[stage] == pytest.approx(stage_breakdown(s, stage).total, rel=1e-9)


# ------------------------------------------------------------------ the rules


def test_delayed_fp8_scaling_refuses_the_discarding_modules() -> None:
    """transformer_config.py: "Delayed scaling does not support moe_act and layernorm
    recompute for fp8"."""
    def make(fp8: str, **parallel: Any) -> Scenario:
        return scenario_from_dict({
            "name": "fp8", "stack": {"preset": "megatron-core", "fp8": fp8}, "model": DENSE,
            "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": 1},
            "parallel": parallel, "training": {"global_batch": 4, "micro_batch": B,
                                               "dtype": "bf16"}})
    with pytest.raises(ScenarioError, match="delayed scaling does not support"):
        make("delayed", recompute="selective", recompute_modules=["layernorm"])
    # current scaling: the linears keep 1-byte FP8 inputs, which layernorm drops
    s = make("current", recompute="selective", recompute_modules=["layernorm"])
    assert kept(make("current")) - kept(s) == pytest.approx(2 * 1 * T * H, rel=1e-12)


@pytest.mark.parametrize(("model", "parallel", "words"), [
    (DENSE, {"recompute": "full", "recompute_modules": ["layernorm"]},
     ["parallel.recompute_modules", "needs parallel.recompute: selective"]),
    (DENSE, {"recompute": "selective", "recompute_modules": ["mla_up_proj"]},
     ["parallel.recompute_modules", "model.mla unset"]),
    (MOE, {"recompute": "op"}, ["parallel.recompute = 'op'", "dense layers"]),
    (DENSE, {"recompute": "selective", "recompute_modules": ["attn"]},
     ["parallel.recompute_modules"]),
])
def test_rules_name_field_value_and_fix(model: dict[str, Any], parallel: dict[str, Any],
                                        words: list[str]) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario(model, **parallel)
    for word in words:
        assert word in str(err.value)


def test_the_cli_takes_a_list_and_refuses_a_bad_module(tmp_path: Any,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    path = str(tmp_path / "s.yaml")
    scenario_yaml = ("name: t\nmodel: {layers: 4, hidden: 256, heads: 8, vocab: 1024, "
                     "seq_len: 128}\ncluster: {system: dgx-a100-80gb, nodes: 1, "
                     "gpus_per_node: 1}\nparallel: {recompute: selective}\n"
                     "training: {global_batch: 4}\n")
    (tmp_path / "s.yaml").write_text(scenario_yaml)
    assert main(["memory", path, "--set", "parallel.recompute_modules=[layernorm,mlp]"]) == 0
    assert "selective (layernorm, mlp)" in capsys.readouterr().out
    assert main(["memory", path, "--set", "parallel.recompute_modules=[norms]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parallel.recompute_modules" in err

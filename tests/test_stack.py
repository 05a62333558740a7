"""The training stack as data, the op inventory it derives, and the terms it adds.

Closed forms pin each term: what a layer keeps for backward under every stack (the
memory model and the op inventory must agree, property-tested over models and
stacks), the host-bound regime, causal flash attention, the optimizer's bytes, fp32
gradient reductions, blocking sends. Every bundled scenario names a stack and has an
op table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.builder.workload import build_workload
from simulator.errors import ScenarioError
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import kept_for_backward
from simulator.model.inventory.ops import CORE_OPS, Op
from simulator.model.inventory.optimizer import optimizer_op
from simulator.model.memory import activation_bytes_per_layer
from simulator.outputs.ops_table import op_rows
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.model_spec import ModelSpec
from simulator.spec.scenario import OverlapSpec
from simulator.spec.stack import (
    STACKS_DIR,
    StackSpec,
    default_stack,
    load_stack,
    preset_stack_names,
)
from simulator.system.costs import CostModel

SCENARIOS = sorted((Path(__file__).parent.parent / "scenarios").glob("*.yaml"))
STACKS = preset_stack_names()


def test_presets_load_and_every_value_has_its_source() -> None:
    assert set(STACKS) == {"megatron-2021", "megatron-2022", "megatron-core", "torchtitan",
                           "deepspeed", "pytorch-eager", "composer-fsdp1"}
    for name in STACKS:
        stack = load_stack(name)
        assert stack.name == name
        lines = (STACKS_DIR / f"{name}.yaml").read_text().splitlines()
        for i, line in enumerate(lines):
            key = re.match(r"^([a-z_]+):", line)
            if not key or key.group(1) in ("name", "description", "fusions"):
                continue
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            assert "#" in line or nxt.lstrip().startswith("#"), f"{name}: {line!r} has no source"


def _scenario(**stack: object) -> dict[str, object]:
    return {"name": "t", "model": {"preset": "tiny-gpt"},
            "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 2},
            "parallel": {"dp": 2}, "training": {"global_batch": 4}, **stack}


def test_a_set_on_a_stack_named_plainly_overrides_that_stack() -> None:
    """``stack: torchtitan`` then ``--set stack.optimizer=fused``: a field of the named
    preset changes; the stack stays torchtitan (it silently became megatron-core)."""
    path = Path(__file__).resolve().parent.parent / "scenarios" / "llama2-70b-fsdp.yaml"
    assert re.search(r"^stack: torchtitan\b", path.read_text(), re.MULTILINE)
    plain = load_scenario(path)
    s = load_scenario(path, ["stack.optimizer=fused"])
    assert (s.stack.name, s.stack.optimizer) == ("torchtitan", "fused")
    assert s.stack.model_copy(update={"optimizer": plain.stack.optimizer}) == plain.stack


def test_stack_section_forms() -> None:
    assert scenario_from_dict(_scenario()).stack.name == "megatron-core"  # the default
    assert scenario_from_dict(_scenario(stack="torchtitan")).stack.attention == "flash2"
    over = scenario_from_dict(_scenario(stack={"preset": "megatron-2021",
                                               "hidden_dropout": 0.0})).stack
    assert (over.name, over.hidden_dropout, over.attention_dropout) == ("megatron-2021", 0, 0.1)
    partial = scenario_from_dict(_scenario(stack={"host_overhead_us": 3.0})).stack
    assert (partial.name, partial.host_us) == ("megatron-core", 3.0)


@pytest.mark.parametrize(("stack", "field", "fix"), [
    ("megatron-202", "stack", "did you mean 'megatron-2022'"),
    ({"attention": "flash9"}, "stack.attention", "must be one of"),
    ({"hidden_dropout": 1.5}, "stack.hidden_dropout", "must be <"),
    ({"fusions": ["qkv"]}, "stack.fusions", "must be one of"),
])
def test_bad_stack_is_one_line_naming_the_field(stack: object, field: str, fix: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(_scenario(stack=stack))
    text = str(err.value)
    assert field in text and fix in text and "\n" not in text.strip()




@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_bundled_scenario_names_its_stack_and_has_an_op_table(path: Path) -> None:
    assert re.search(r"^stack:", path.read_text(), flags=re.M), path.name
    s = load_scenario(path)
    rows = op_rows(s)
    layer = [r for r in rows if r["part"].startswith("layer")]
    assert layer and sum(r["share"] for r in layer) == pytest.approx(
        len({r["part"] for r in layer}))
    assert {r["bound"] for r in rows} <= {"compute", "memory", "overhead"}


def test_gpt3_megatron_2021_table_lists_unfused_attention_dropouts_and_fp32_main_grads() -> None:
    s = load_scenario(Path(__file__).parent.parent / "scenarios" / "gpt3-175b-1024.yaml")
    assert s.stack.name == "megatron-2021"
    names = {(r["pass"], r["op"]) for r in op_rows(s)}
    for op in ("attn_scores", "attn_softmax", "attn_dropout", "attn_av", "residual"):
        assert ("forward", op) in names
    assert ("backward weight", "main_grad") in names
    assert ("forward", "embedding_dropout") in names


# ---------------------------------------------------------------- kept for backward

dense_specs = st.builds(
    lambda layers, heads, head_dim, kv_div, ffn_mul, s, act, norm, bias, pos, apart: ModelSpec(
        layers=layers, hidden=heads * head_dim * 3 // 4 if apart else heads * head_dim,
        heads=heads, head_dim=head_dim if apart else None, kv_heads=heads // kv_div,
        ffn_hidden=ffn_mul * heads * head_dim, vocab=1000, seq_len=s, activation=act,
        norm=norm, bias=bias, position=pos),
    st.integers(1, 4), st.sampled_from([4, 8, 16]), st.sampled_from([16, 32, 64]),
    st.sampled_from([1, 2, 4]), st.integers(2, 4), st.sampled_from([64, 128, 512]),
    st.sampled_from(["gelu", "swiglu"]), st.sampled_from(["layernorm", "rmsnorm"]),
    st.booleans(), st.sampled_from(["learned", "rope"]),
    st.booleans())  # heads x head_dim wider than hidden (Qwen3's model.head_dim)


def _closed_form(spec: ModelSpec, b: int, tp: int, sp: bool, stack: StackSpec,
                 recompute: str) -> float:
    """What one layer keeps, written out independently of the inventory."""
    dt, h, s = 2, spec.hidden, spec.seq_len
    T = b * s
    L = T / tp if sp else T
    rs = 4 if stack.amp(dt) else dt  # autocast: the residual stream is fp32
    g = 1 if stack.fp8 != "none" else dt  # FP8 linears keep their FP8 (column-wise) input
    if recompute == "full":
        return rs * L * h
    q, kv = spec.heads * spec.head_size / tp, max(spec.kv / tp, 1) * spec.head_size
    f = spec.ffn / tp
    heads = spec.heads / tp
    S = b * heads * s * s
    # the two norms' and the QKV and MLP-up projections' inputs: under SP Megatron's
    # projections keep the shard (and re-gather it), DTensor's matmuls the gathered whole
    Lin = T if sp and stack.sp_input_backward == "saved" else L
    out = 2 * rs * L * h + 2 * g * Lin * h
    out += 2 * L * h if stack.hidden_dropout > 0 else 0  # two 1-byte masks
    out += dt * T * (q + 2 * kv)  # Q, K, V
    # the out-projection's input: one copy, FP8 or DeepSeek-V3's 12-bit E5M6 (1.5 bytes)
    out += (1.5 if stack.fp8_cache == "deepseek" else g) * T * q
    # the activation's input: GeLU's; SwiGLU's gate and up, and unfused SiLU's output too
    # (derivatives.yaml: silu saves its input, mul both operands)
    out += dt * T * f * ((2 if stack.fused("bias_act") else 3) if spec.activation == "swiglu"
                         else 1)
    out += g * T * f  # the MLP-down projection's input
    if recompute == "selective":
        return out
    if stack.flash:  # the fp32 log-sum-exp, and under FP8 linears (not DeepSeek-V3's one
        # E5M6 copy) the fused core's own 16-bit output beside the out-projection's copy
        own = dt * T * q if stack.fp8 != "none" and stack.fp8_cache != "deepseek" else 0
        return out + 4 * T * heads + own
    return out + dt * S + ((dt + 1) * S if stack.attention_dropout > 0 else 0)


#: A preset's variants the property also runs: autocast as our CUDA runs execute, FP8 linears,
#: FP8 linears caching as DeepSeek-V3 does (stack.fp8_cache)
EXTRAS: dict[str, dict[str, object]] = {
    "autocast": {"autocast": True}, "fp8": {"fp8": "delayed"},
    "deepseek": {"fp8": "blockwise", "fp8_cache": "deepseek"}}


@settings(max_examples=80, deadline=None)
@given(dense_specs, st.integers(1, 3), st.sampled_from([1, 2, 4]), st.booleans(),
       st.sampled_from([*STACKS, "pytorch-eager+autocast", "megatron-core+fp8",
                        "torchtitan+fp8", "megatron-core+deepseek"]),
       st.sampled_from(["none", "selective", "full"]))
def test_memory_and_inventory_agree_on_what_is_kept(spec: ModelSpec, b: int, tp: int, sp: bool,
                                                   name: str, recompute: str) -> None:
    preset, _, extra = name.partition("+")
    stack = load_stack(name) if not extra else StackSpec.model_validate(
        {"preset": preset, **EXTRAS[extra]})
    memory = activation_bytes_per_layer(spec, b, tp, sp, recompute, stack=stack)  # type: ignore[arg-type]
    inventory = kept_for_backward(spec, b, tp, sp, "bf16", recompute, stack)
    assert memory == inventory
    assert memory == pytest.approx(_closed_form(spec, b, tp, sp, stack, recompute), rel=1e-12)
    fwd = mdl.layer_ops(spec, b, tp, sp, "bf16", "fwd", stack=stack)
    if recompute == "none":
        assert memory == pytest.approx(sum(op.saved for op in fwd), rel=1e-12)
    if recompute == "selective":  # what it drops is exactly what it re-runs
        rerun = mdl.layer_recompute_ops(spec, b, tp, sp, "bf16", "selective", stack=stack)
        assert {op.name for op in rerun} <= set(CORE_OPS)
    assert all(op.saved == 0 for p in ("bwd_input", "bwd_weight")
               for op in mdl.layer_ops(spec, b, tp, sp, "bf16", p, stack=stack))  # type: ignore[arg-type]


def test_sequence_parallel_projections_keep_the_shard_under_megatron_the_whole_as_dtensor(
) -> None:
    """Megatron keeps the QKV and MLP-up inputs as the sequence shard (and re-gathers
    them in backward); DTensor's matmuls keep the all-gathered tensor autograd saved:
    t times as much for those two, the rest of the layer alike."""
    spec = ModelSpec(layers=2, hidden=256, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1000,
                     seq_len=512)
    b, tp, T, h = 2, 4, 2 * 512, 256
    kept = {name: {op.name: op.saved for op in mdl.layer_ops(spec, b, tp, True, "bf16", "fwd",
                                                            stack=load_stack(name))}
            for name in ("megatron-core", "torchtitan")}
    assert kept["megatron-core"]["qkv"] == kept["megatron-core"]["mlp_up"] == 2 * T * h / tp
    assert kept["torchtitan"]["qkv"] == kept["torchtitan"]["mlp_up"] == 2 * T * h
    assert kept["torchtitan"]["ln1"] == kept["megatron-core"]["ln1"]  # the norm: its shard
    titan = load_stack("torchtitan")
    regather = StackSpec.model_validate({"preset": "torchtitan", "sp_input_backward": "regather"})
    for sp in (True, False):  # the field moves the two projections' inputs, under SP only
        got = activation_bytes_per_layer(spec, b, tp, sp, "none", stack=titan) \
            - activation_bytes_per_layer(spec, b, tp, sp, "none", stack=regather)
        assert got == pytest.approx(2 * 2 * T * h * (1 - 1 / tp) if sp else 0.0)


moe_specs = st.builds(
    lambda heads, head_dim, experts, k, cap, shared, act, dense: ModelSpec(
        layers=4, hidden=heads * head_dim, heads=heads, kv_heads=heads, ffn_hidden=4 * heads
        * head_dim, vocab=1000, seq_len=128, activation=act, experts=experts,
        experts_per_token=k, capacity_factor=cap, shared_experts=shared,
        expert_ffn_hidden=2 * heads * head_dim, first_dense_layers=dense),
    st.sampled_from([4, 8]), st.sampled_from([16, 32]), st.sampled_from([4, 8]),
    st.integers(1, 2), st.sampled_from([None, 1.0, 1.25]), st.integers(0, 1),
    st.sampled_from(["gelu", "swiglu"]), st.integers(0, 1))


@settings(max_examples=60, deadline=None)
@given(moe_specs, st.integers(1, 2), st.sampled_from([1, 2, 4]), st.booleans(),
       st.sampled_from(STACKS), st.integers(0, 3))
def test_a_moe_layers_memory_is_what_its_ops_keep(spec: ModelSpec, b: int, tp: int,
                                                   sp: bool, name: str, layer: int) -> None:
    """MoE layers: the memory model reads their forward ops' saved bytes, and those add
    up to the closed form: the dense layer's (:func:`_closed_form`: norms, attention as
    the stack runs it, residual masks) with its MLP replaced by the router's fp32
    probabilities (4E per local token) and the experts': the c·k permuted copies of
    each token, each expert's activation input and down-projection input (3 or 2 × f_e/t
    with SwiGLU or GeLU), the shared experts' likewise per token. The router keeps the
    normed input as the MLP-up projection does. A dense layer of the model is a dense
    layer."""
    stack = load_stack(name)
    memory = activation_bytes_per_layer(spec, b, tp, sp, "none", "bf16", layer=layer,
                                        stack=stack)
    fwd = mdl.layer_ops(spec, b, tp, sp, "bf16", "fwd", layer, stack)
    assert memory == pytest.approx(sum(op.saved for op in fwd), rel=1e-12)
    assert memory == kept_for_backward(spec, b, tp, sp, "bf16", "none", stack, layer)
    dt, h, T = 2, spec.hidden, b * spec.seq_len
    L = T / tp if sp else T
    unit = 3 if spec.activation == "swiglu" else 2  # an expert's, fused
    dense = unit + (1 if spec.activation == "swiglu" and not stack.fused("bias_act") else 0)
    want = _closed_form(spec, b, tp, sp, stack, "none")
    if spec.is_moe_layer(layer):
        pairs = T * spec.experts_per_token * (spec.capacity_factor or 1.0)
        routed = T if sp and stack.sp_input_backward == "saved" else L  # DTensor: the gathered
        want += -dt * T * dense * spec.ffn / tp + 4 * routed * spec.experts \
            + pairs * dt * (h + unit * spec.expert_ffn / tp) \
            + T * dt * unit * spec.shared_experts * spec.expert_ffn / tp
    assert memory == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_memory_reads_the_inventory_of_every_scenario(path: Path) -> None:
    """Every layer kind of every bundled scenario (dense, MoE, dense layers of a MoE
    model, latent attention), under each recomputation mode that keeps activations: the
    memory model's bytes are what the layer's forward ops save. Context parallelism keeps
    the local chunk of s / cp tokens with a fused core."""
    s = load_scenario(path)
    spec, par = s.model, s.parallel
    b, dt, stack = s.training.micro_batch, s.training.dtype, s.stack
    local = spec if par.cp == 1 else spec.model_copy(update={"seq_len": spec.seq_len // par.cp})
    if par.cp > 1 and not stack.flash:
        stack = stack.model_copy(update={"attention": "flash2"})
    layers = sorted({0, spec.layers - 1, *(i for i in range(min(spec.layers, 8)))})
    for layer in layers:
        fwd = mdl.layer_ops(local, b, par.tp, par.sequence_parallel, dt, "fwd", layer, stack)
        memory = activation_bytes_per_layer(spec, b, par.tp, par.sequence_parallel, "none", dt,
                                            layer=layer, cp=par.cp, stack=s.stack)
        assert memory > 0
        assert memory == pytest.approx(sum(op.saved for op in fwd), rel=1e-12), layer


# ---------------------------------------------------------------- cost terms


def test_host_bound_regime_and_cuda_graphs() -> None:
    s = scenario_from_dict(_scenario())
    tiny = Op("tiny", "memory", 0.0, 1e3, 0.0, "elementwise", 5)
    eager = CostModel(s.hardware, "bf16", host_us=10.0)
    assert eager.op_time(tiny) == pytest.approx(5 * 10e-6)  # five launches' host time
    assert eager.bound(tiny) == "overhead"
    graphs = load_stack("megatron-core").model_copy(update={"cuda_graphs": True})
    assert graphs.host_us == 0.0
    big = Op("big", "memory", 0.0, 1e10, 0.0, "elementwise", 1)
    assert eager.op_time(big) == CostModel(s.hardware, "bf16").op_time(big)  # hidden


def test_causal_flash_executes_half_the_counted_flops() -> None:
    spec = default_stack()
    gpt = scenario_from_dict({**_scenario(), "model": {"preset": "gpt3-175b"}}).model
    flash = next(op for op in mdl.layer_ops(gpt, 1, 8, stack=spec) if op.name == "attn_core")
    assert flash.compute_scale == 0.5
    assert flash.flops == 4 * gpt.seq_len**2 * gpt.hidden / 8  # counted: the full square


def test_optimizer_bytes_per_parameter() -> None:
    # bf16 with fp32 main grads: read g (4), read+write master, m, v (24), write bf16 (2);
    # clipping reads the grads and scales them in place (3 × 4)
    mega = load_stack("megatron-2021")
    assert optimizer_op(1e9, 100, mega, "bf16").bytes == pytest.approx(1e9 * (30 + 12))
    ds = load_stack("deepspeed")  # 16-bit gradients
    assert optimizer_op(1e9, 100, ds, "bf16").bytes == pytest.approx(1e9 * (28 + 6))
    eager = load_stack("pytorch-eager")  # for-loop AdamW, no clipping: 10 ops a tensor
    assert optimizer_op(1e6, 40, eager, "fp32").kernels == 10 * 40


def test_fp32_reduction_doubles_the_gradient_bytes() -> None:
    def dp_bytes(stack: str) -> float:
        s = scenario_from_dict(_scenario(stack=stack))
        w = build_workload(s)
        return sum(t.nbytes for t in w.tasks if t.kind == "dp" and t.rank == 0)
    assert dp_bytes("megatron-core") == pytest.approx(2 * dp_bytes("deepspeed"))


def test_blocking_sends_and_after_backward_reduction() -> None:
    want = OverlapSpec()
    assert load_stack("megatron-2021").overlap(want) == OverlapSpec(dp=False, pp=False)
    assert load_stack("torchtitan").overlap(want) == want
    assert load_stack("megatron-core").overlap(want) == OverlapSpec(pp=False)


def test_ddp_first_bucket_closes_at_its_own_cap() -> None:
    """torch DDP's first bucket of a backward holds 1 MiB (``ddp_first_bucket_MB`` of the
    ``pytorch-eager`` stack), the rest ``dp_bucket_MB``: a model of a few MB reduces in
    two all-reduces, the first one the size of the first units that reach 1 MiB."""
    from simulator.strategies.compression import arithmetic as cmp

    assert cmp.buckets([0.6e6] * 5, (1.048576e6, 25e6)) == [[0, 1], [2, 3, 4]]
    assert cmp.buckets([0.6e6] * 5, (25e6, 25e6)) == [[0, 1, 2, 3, 4]]

    def reductions(**stack: object) -> list[float]:
        s = scenario_from_dict(_scenario(stack={"preset": "pytorch-eager", **stack}))
        assert cmp.bucket_caps(s)[0] == min(s.stack.ddp_first_bucket_MB or 25.0, 25.0) * 1e6
        w = build_workload(s)
        return [t.nbytes for t in w.tasks if t.kind == "dp" and t.rank == 0]

    plain, torch_ddp = reductions(ddp_first_bucket_MB=0), reductions()
    assert len(plain) == 1 and len(torch_ddp) == 2
    assert sum(torch_ddp) == pytest.approx(plain[0])
    assert 1.048576e6 <= torch_ddp[0] < plain[0]

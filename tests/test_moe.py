"""Mixture-of-experts and latent-attention arithmetic against published parameter counts
and hand calculations (simulator/model/moe.py)."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.model import moe
from simulator.model.memory import activation_bytes_per_layer, stage_expert_params, stage_params
from simulator.model.transformer import (
    PASSES,
    active_param_count,
    embedding_params,
    hardware_flops_per_step,
    head_params,
    layer_ops,
    layer_params,
    model_flops_per_step,
    ops_flops,
    param_count,
)
from simulator.spec.model_spec import ModelSpec, load_preset_model

MIXTRAL = load_preset_model("mixtral-8x7b")
DSV3 = load_preset_model("deepseek-v3")


def small_moe(**kw: object) -> ModelSpec:
    base: dict[str, object] = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 100,
                               "seq_len": 32, "activation": "swiglu", "norm": "rmsnorm",
                               "bias": False, "tied_embeddings": False, "position": "rope",
                               "experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 96}
    return ModelSpec.model_validate({**base, **kw})


# ---------------------------------------------------------------- published totals

# Mixtral 8x7B: Mistral AI, "Mixtral of experts" (2023-12-11) and Jiang et al. 2024:
# 46.7B parameters, 12.9B used per token (input embedding counted). DeepSeek-V3 technical
# report (arXiv:2412.19437): 671B in the main model (the multi-token-prediction module's
# 11.5B left out), "37B activated"; the release's README_WEIGHTS.md gives the activated
# count as 36.6B, the output head included and the input embedding not.
PUBLISHED = [
    ("mixtral-8x7b total", param_count(MIXTRAL), 46.7e9),
    ("mixtral-8x7b active", active_param_count(MIXTRAL, embedding=True), 12.9e9),
    ("deepseek-v3 total", param_count(DSV3), 671e9),
    ("deepseek-v3 active", active_param_count(DSV3, embedding=False), 36.6e9),
]


@pytest.mark.parametrize(("name", "ours", "published"), PUBLISHED,
                         ids=[p[0] for p in PUBLISHED])
def test_moe_param_counts_match_published_to_half_a_percent(name: str, ours: int,
                                                            published: float) -> None:
    assert ours == pytest.approx(published, rel=5e-3)


def test_deepseek_v3_active_rounds_to_the_headline_37b() -> None:
    # "37B" is two significant figures: 36.5B <= x < 37.5B
    assert 36.5e9 <= active_param_count(DSV3, embedding=False) < 37.5e9


def test_mixtral_total_is_the_checkpoint_count_exactly() -> None:
    # Hugging Face safetensors metadata of mistralai/Mixtral-8x7B-v0.1: 46,702,792,704
    assert param_count(MIXTRAL) == 46_702_792_704


def test_mixtral_layer_by_hand() -> None:
    h, kv, f = 4096, 8 * 128, 14336
    attention = 2 * h * h + 2 * h * kv
    expert = 3 * h * f
    assert layer_params(MIXTRAL, 5) == attention + 8 * expert + h * 8 + 2 * h
    assert moe.active_layer_params(MIXTRAL, 5) == attention + 2 * expert + h * 8 + 2 * h
    assert embedding_params(MIXTRAL) == 32000 * h
    assert head_params(MIXTRAL) == h + 32000 * h


def test_deepseek_v3_mla_by_hand() -> None:
    # DeepSeek-V3 config.json: q_a_proj 7168x1536, q_a_layernorm 1536, q_b_proj
    # 1536x(128*192), kv_a_proj_with_mqa 7168x(512+64), kv_a_layernorm 512, kv_b_proj
    # 512x(128*(128+128)), o_proj (128*128)x7168
    assert moe.attention_params(DSV3) == (7168 * 1536 + 1536 + 1536 * 128 * 192
                                          + 7168 * 576 + 512 + 512 * 128 * 256
                                          + 128 * 128 * 7168) == 187_107_328


def test_deepseek_v3_layer_kinds() -> None:
    assert moe.layer_kinds(DSV3) == [(0, 3), (3, 58)]
    assert not DSV3.is_moe_layer(2) and DSV3.is_moe_layer(3) and DSV3.is_moe_layer(60)
    dense = 187_107_328 + 3 * 7168 * 18432 + 2 * 7168
    assert layer_params(DSV3, 0) == dense
    routed = 256 * 3 * 7168 * 2048
    router = 256 * 7168 + 256  # sigmoid router: weight and the balancing bias
    assert layer_params(DSV3, 3) == 187_107_328 + 2 * 7168 + router + 3 * 7168 * 2048 + routed
    assert moe.expert_params(DSV3, 3) == routed and moe.expert_params(DSV3, 0) == 0


@pytest.mark.parametrize(("kw", "kinds", "moe_layers"), [
    ({}, [(0, 4)], 4),
    ({"first_dense_layers": 1}, [(0, 1), (1, 3)], 3),
    ({"moe_layer_freq": 2}, [(1, 2), (0, 2)], 2),
    ({"first_dense_layers": 1, "moe_layer_freq": 2}, [(0, 2), (1, 2)], 2),
])
def test_layer_pattern(kw: dict[str, int], kinds: list[tuple[int, int]], moe_layers: int) -> None:
    spec = small_moe(**kw)
    assert spec.moe_layers == moe_layers
    assert sum(spec.is_moe_layer(i) for i in range(spec.layers)) == moe_layers
    assert sorted(moe.layer_kinds(spec)) == sorted(kinds)
    assert sum(n for _, n in moe.layer_kinds(spec)) == spec.layers


# ---------------------------------------------------------------- FLOPs


def gemm(spec: ModelSpec, layer: int, batch: int) -> float:
    return sum(ops_flops(layer_ops(spec, batch, 1, False, "bf16", p, layer)) for p in PASSES)


def test_moe_layer_flops_are_six_per_active_matrix_param_per_token_plus_attention() -> None:
    # no biases: forward + backward GEMMs are 6 FLOPs per parameter a token uses, the
    # router included; attention adds 12·b·s²·h (3 × 4bs²h)
    spec, b = MIXTRAL, 2
    tokens, s, h = b * spec.seq_len, spec.seq_len, spec.hidden
    matrices = moe.active_layer_params(spec, 0) - 2 * h
    assert gemm(spec, 0, b) == pytest.approx(6 * matrices * tokens + 12 * b * s**2 * h,
                                              rel=1e-12)


def test_mla_attention_core_flops() -> None:
    # QKᵀ over d_qk = 192 and AV over d_v = 128 for 128 heads: 2·b·s²·H·(192 + 128)
    ops = {op.name: op for op in layer_ops(DSV3, 1, 1, False, "bf16", "fwd", 0)}
    s = DSV3.seq_len
    assert ops["attn_core"].flops == 2 * s**2 * 128 * (192 + 128)
    assert ops["q_up"].flops == 2 * s * 1536 * 128 * 192


def test_mla_down_projections_are_replicated_across_tp() -> None:
    one = {op.name: op.flops for op in layer_ops(DSV3, 1, 1)}
    eight = {op.name: op.flops for op in layer_ops(DSV3, 1, 8)}
    for name in ("q_down", "kv_down"):
        assert eight[name] == one[name]
    for name in ("q_up", "kv_up", "out_proj", "attn_core", "mlp_up", "mlp_down"):
        assert eight[name] * 8 == pytest.approx(one[name], rel=1e-12)


def test_expert_flops_are_top_k_of_the_experts() -> None:
    spec, b = small_moe(), 3
    tokens, h, f = b * spec.seq_len, spec.hidden, spec.expert_ffn
    ops = {op.name: op for op in layer_ops(spec, b)}
    assert ops["expert_up"].flops == 2 * tokens * 2 * h * 2 * f  # k = 2, SwiGLU gate + up
    assert ops["expert_down"].flops == 2 * tokens * 2 * f * h
    assert ops["expert_up"].gemm_flops == ops["expert_up"].flops / 8  # one expert's GEMM
    assert ops["router"].flops == 2 * tokens * h * 8
    more = {op.name: op for op in layer_ops(small_moe(experts=32), b)}
    assert more["expert_up"].flops == ops["expert_up"].flops  # more experts, same top-k work


def test_shared_experts_run_on_every_token() -> None:
    spec, b = small_moe(shared_experts=2), 1
    ops = {op.name: op for op in layer_ops(spec, b)}
    tokens, h, f = spec.seq_len, spec.hidden, spec.expert_ffn
    assert ops["shared_up"].flops == 2 * tokens * h * 2 * 2 * f
    assert ops["shared_down"].flops == 2 * tokens * 2 * f * h


def test_capacity_factor_pads_hardware_flops_not_model_flops() -> None:
    dropless, padded = small_moe(), small_moe(capacity_factor=1.5)
    batch = 4
    assert model_flops_per_step(padded, batch) == model_flops_per_step(dropless, batch)
    experts = sum(op.flops for p in PASSES for op in layer_ops(dropless, batch, pass_=p)
                  if op.name.startswith("expert_"))
    extra = hardware_flops_per_step(padded, batch, "none") - model_flops_per_step(padded, batch)
    assert extra == pytest.approx(0.5 * experts * padded.layers, rel=1e-12)


def test_model_flops_sum_the_layer_kinds() -> None:
    batch = 2
    by_layer = sum(gemm(DSV3, i, batch) for i in range(DSV3.layers))
    ends = model_flops_per_step(DSV3, batch) - by_layer
    assert ends == pytest.approx(3 * 2 * batch * DSV3.seq_len * DSV3.hidden * DSV3.vocab,
                                 rel=1e-9)


# ---------------------------------------------------------------- memory


def test_stage_params_and_expert_share() -> None:
    assert stage_params(DSV3, 1, 0) == param_count(DSV3)
    assert sum(stage_expert_params(DSV3, 61, s) for s in range(61)) == 58 * moe.expert_params(
        DSV3, 3)
    assert stage_expert_params(MIXTRAL, 4, 1) == 8 * moe.expert_params(MIXTRAL, 0)


def test_moe_activations_grow_with_top_k() -> None:
    one = activation_bytes_per_layer(small_moe(experts_per_token=1), 1)
    two = activation_bytes_per_layer(small_moe(experts_per_token=2), 1)
    h, f, tokens = 64, 96, 32
    # one more permuted copy (2h bytes) and expert activation (SwiGLU 6f) per token
    assert two - one == pytest.approx(tokens * (2 * h + 6 * f), rel=1e-12)


def test_context_parallel_divides_activations() -> None:
    spec = load_preset_model("llama2-7b")
    whole = activation_bytes_per_layer(spec, 1, 2, True, "none")
    assert activation_bytes_per_layer(spec, 1, 2, True, "none", cp=4) == pytest.approx(
        whole / 4, rel=1e-12)


@pytest.mark.parametrize("layers", [1, 5, 12])
@pytest.mark.parametrize("first", [0, 1, 3])
@pytest.mark.parametrize("freq", [1, 2, 3])
def test_layer_kinds_of_any_range_count_like_a_loop(layers: int, first: int, freq: int) -> None:
    if first >= layers:
        return
    spec = small_moe(layers=layers, first_dense_layers=first, moe_layer_freq=freq)
    for a in range(layers + 1):
        for b in range(a, layers + 1):
            kinds = moe.layer_kinds(spec, a, b)
            assert all(a <= i < b for i, _ in kinds)
            by_loop = sum(spec.is_moe_layer(i) for i in range(a, b))
            assert sum(n for i, n in kinds if spec.is_moe_layer(i)) == by_loop
            assert sum(n for i, n in kinds if not spec.is_moe_layer(i)) == b - a - by_loop


def test_a_billion_moe_layers_cost_no_loop() -> None:
    spec = small_moe(layers=10**9, first_dense_layers=7, moe_layer_freq=3)
    assert spec.moe_layers == -(-(10**9 - 7) // 3)
    assert stage_params(spec, 1, 0) == param_count(spec)
    assert stage_expert_params(spec, 1, 0) == spec.moe_layers * moe.expert_params(spec, 7)


# ---------------------------------------------------------------- the kernel-level frame


def _tiny_moe(**kw: object) -> ModelSpec:
    return ModelSpec.model_validate({
        "layers": 4, "hidden": 128, "heads": 4, "ffn_hidden": 512, "vocab": 512, "seq_len": 64,
        "activation": "gelu", "norm": "layernorm", "bias": True, "experts": 4,
        "experts_per_token": 2, "expert_ffn_hidden": 512, "capacity_factor": 1.0, **kw})


@pytest.mark.parametrize("stack", ["pytorch-eager", "megatron-core", "megatron-2021"])
@pytest.mark.parametrize("pass_", ["fwd", "bwd_input", "bwd_weight"])
def test_a_moe_layer_is_the_dense_frame_with_the_mlp_replaced(stack: str, pass_: str) -> None:
    """A routed-experts layer runs the dense layer's attention half as the stack runs it
    (q, k, v apart under pytorch-eager, unfused attention under megatron-2021, their
    dgrad/wgrad classes), then router, permutation, experts and un-permutation; its
    FLOPs are the stack's-independent sum of both."""
    from simulator.model.inventory.dense import dense_layer_ops
    from simulator.model.inventory.experts import EAGER_ROUTING
    from simulator.model.transformer import layer_ops
    from simulator.spec.stack import load_stack

    st = load_stack(stack)
    spec = _tiny_moe()
    dense = spec.model_copy(update={"experts": 0})
    got = layer_ops(spec, 2, 1, False, "fp32", pass_, 0, st)  # type: ignore[arg-type]
    frame = dense_layer_ops(dense, 2, 1, False, "fp32", pass_, st)  # type: ignore[arg-type]
    names = [op.name for op in got]
    if pass_ != "bwd_weight":
        order = names if pass_ == "fwd" else names[::-1]
        cut = order.index("ln2")
        dense_order = [op.name for op in (frame if pass_ == "fwd" else frame[::-1])]
        assert order[:cut] == dense_order[:dense_order.index("ln2")]  # the attention half
        tail = ["residual"] if "residual" in dense_order[dense_order.index("ln2"):] else []
        assert [n for n in order[cut:] if n not in ("up_grad_sum", "grad_sum")] == [
            "ln2", "router", "permute", "expert_up", "expert_act", "expert_down",
            *(["expert_buffers"] if stack == "pytorch-eager" else []), "unpermute", *tail]
        if pass_ == "bwd_input":  # router, permutation: two readers of the normed input
            assert {op.name: op for op in got}["up_grad_sum"].kernels == 1
        kernels = {op.name: op.kernels for op in got}
        want = EAGER_ROUTING[pass_] if stack == "pytorch-eager" else (1, 1)
        assert (kernels["permute"], kernels["unpermute"]) == want
        by = {op.name: op for op in frame}
        for name in ("qkv", "out_proj", "ln1"):
            assert {op.name: op for op in got}[name] == by[name]
    else:  # wgrads: the attention's, the router's, the experts'; the layer's own grads
        assert names[:2] == ["qkv", "out_proj"] and "router" in names
        assert {op.cost_class for op in got if op.kind == "gemm"} == {"gemm_wgrad"}
        accum = {op.name: op for op in got}.get("grad_accum")
        # q, k, v (or QKV) and out-proj with biases, two layernorms' γ and β, the router
        linears = (3 if stack == "pytorch-eager" else 1) + 1
        if st.main_grads == "param":
            assert accum is not None and accum.kernels == 2 * linears + 4 + 1
    flops = sum(op.flops for op in got)
    assert flops == pytest.approx(sum(op.flops for op in layer_ops(
        spec, 2, 1, False, "fp32", pass_, 0, load_stack("megatron-core"))))  # type: ignore[arg-type]


def test_parameter_tensors_are_the_measured_workers_own() -> None:
    """The optimizer's and DDP's per-tensor counts: a MoE layer's own tensors (attention,
    norms, router) and its routed experts' on a rank, as our measured MoE worker builds
    them (one MLP module per local expert), and the dense GPT's."""
    torch = pytest.importorskip("torch")
    from calibration.measured.gpt import GPT, GPTConfig
    from calibration.measured.moe_worker import MoEMLP
    from simulator.model.inventory.experts import expert_tensors
    from simulator.model.inventory.layer import layer_tensors
    from simulator.spec.stack import load_stack

    eager, spec = load_stack("pytorch-eager"), _tiny_moe()
    cfg = GPTConfig(layers=4, hidden=128, heads=4, ffn_hidden=512, vocab=512, seq_len=64)
    with torch.random.fork_rng(devices=[]):
        model = GPT(cfg)
        dense = sum(1 for _ in model.parameters())  # the tied head shares the table
        for block in model.layers.values():
            block.mlp = MoEMLP(cfg, 4, 2, 1.0, 2, None)  # EP 2: two local experts
    names = [n for n, _ in model.named_parameters()]
    experts = sum(".local_experts." in n for n in names)
    assert dense == 4 * layer_tensors(spec.model_copy(update={"experts": 0}), eager) + 4
    assert len(names) - experts == sum(layer_tensors(spec, eager, i) for i in range(4)) + 4
    assert experts == 4 * expert_tensors(spec, eager, 2) == 32
    assert layer_tensors(spec, eager, 0) == 13  # q, k, v, out with biases; 2 norms; router


def test_grouped_experts_hold_one_tensor_per_projection() -> None:
    """torchtitan's GroupedExperts: w1, w2, w3 for every local expert at once; the
    per-expert modules of the other stacks: one gate/up and down per expert."""
    from simulator.model.inventory.experts import expert_tensors
    from simulator.spec.stack import load_stack

    assert expert_tensors(MIXTRAL, load_stack("torchtitan"), 8) == 3
    assert expert_tensors(MIXTRAL, load_stack("megatron-core"), 8) == 8 * 2  # fc1 holds gate+up
    assert expert_tensors(MIXTRAL, load_stack("deepspeed"), 8) == 8 * 2
    assert expert_tensors(MIXTRAL, load_stack("pytorch-eager"), 8) == 8 * 3  # w1, w3, w2 apart
    assert expert_tensors(MIXTRAL, load_stack("torchtitan"), 0) == 0


def test_the_expert_step_loops_over_the_experts_tensors() -> None:
    """Under a for-loop AdamW (10 kernels per tensor) the experts' own step runs over
    the routed experts' tensors of the rank's MoE layers, the dense step over the rest."""
    from simulator.model import transformer as mdl
    from simulator.spec.load import scenario_from_dict

    s = scenario_from_dict({"name": "t", "model": {**_tiny_moe().model_dump(
        exclude_none=True), "preset": None}, "stack": "pytorch-eager",
        "cluster": {"system": "cpu-1thread", "nodes": 1, "gpus_per_node": 2},
        "parallel": {"dp": 2, "ep": 2}, "training": {"global_batch": 8, "dtype": "fp32"}})
    layers = [range(4)]
    assert mdl.optimizer_op_of(s, 1e5, layers).kernels == 10 * (4 * 13 + 4)
    assert mdl.optimizer_op_of(s, 1e5, layers, "experts").kernels == 10 * 4 * 8
    assert mdl.optimizer_op_of(s, 1e5, layers, "all").kernels == 10 * (4 * 13 + 4 + 32)


class _Exchange:  # the all-to-all as a one-rank copy both ways (its own traffic left out)
    @staticmethod
    def make() -> Any:
        import torch

        class Exchange(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, buf: Any) -> Any:
                return buf.clone()

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return grad.clone()

        return Exchange


def _routing_rows(experts: int, ep: int, hidden: int = 24, tokens: int = 32) -> tuple[
        dict[str, float], dict[str, float]]:
    """Rows of ``hidden`` elements every op of our MoE worker's MLP reads and writes on
    one EP rank (inputs and outputs whose last dimension is ``hidden``), forward and
    backward, counted under a TorchDispatchMode; views, allocations, the experts' and
    router's GEMMs and activations and the exchange's own copies are left out."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from calibration.measured.gpt import GPTConfig
    from calibration.measured.moe_worker import MoEMLP

    free = {"view", "_unsafe_view", "transpose", "t", "select", "unsqueeze", "expand",
            "as_strided", "alias", "detach", "slice", "reshape", "_reshape_alias", "permute",
            "squeeze", "unbind", "split", "empty_like", "empty", "addmm", "mm", "gelu",
            "gelu_backward"}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[str, float] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name in free:
                return out
            read = [] if name.startswith(("new_zeros", "zeros")) else \
                tree_flatten((args, kwargs))[0]
            seen = [t for t in (*read, *tree_flatten(out)[0]) if isinstance(t, torch.Tensor)
                    and t.dim() >= 1 and t.shape[-1] == hidden]
            if seen:
                self.rows[name] = self.rows.get(name, 0) + sum(t.numel() // hidden
                                                               for t in seen)
            return out

    cfg = GPTConfig(layers=1, hidden=hidden, heads=1, ffn_hidden=40, vocab=8, seq_len=tokens)
    torch.manual_seed(0)
    # capacity 2 with top-2 of 4+ experts: no expert overflows (each token picks two
    # different experts), so every pair is kept
    moe = MoEMLP(cfg, experts, 2, 2.0, ep, None)
    exchange = _Exchange.make()
    moe.exchange = lambda buf: exchange.apply(buf.contiguous())  # type: ignore[method-assign]
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    slots = experts * moe.capacity(tokens)
    with Count() as fwd:
        y = moe(x)
    grad = torch.randn_like(y)
    with Count() as bwd:
        y.backward(grad)
    fwd.rows["clone"] = fwd.rows.get("clone", 0) - 4 * slots  # the exchanges' copies
    bwd.rows["clone"] = bwd.rows.get("clone", 0) - 4 * slots
    return fwd.rows, bwd.rows


@pytest.mark.parametrize(("experts", "ep"), [(4, 1), (4, 2), (8, 2), (8, 4)])
def test_eager_routing_moves_what_the_workers_ops_read_and_write(experts: int,
                                                                 ep: int) -> None:
    """The ``eager`` routing's traffic (the rank's own permute and unpermute, and the
    buffers' reshuffle around its E/ep experts) is what our MoE worker's ops read and
    write, counted op by op under a dispatch mode, forward and backward."""
    pytest.importorskip("torch")
    from simulator.model.inventory.experts import eager_buffer_op, eager_routing_rows

    hidden, tokens = 24, 32
    fwd, bwd = _routing_rows(experts, ep, hidden, tokens)
    slots, pairs, local = experts * 2.0 * 2 * tokens / experts, 2.0 * tokens, experts // ep
    for pass_, counted in (("fwd", fwd), ("bwd_input", bwd)):
        buffers = eager_buffer_op(slots, hidden, local, ep, 1, pass_)  # type: ignore[arg-type]
        assert buffers is not None
        model = sum(eager_routing_rows(pass_, tokens, slots, pairs)) \
            + buffers.bytes / hidden  # type: ignore[arg-type]
        assert model == pytest.approx(sum(counted.values()), rel=0.02), (pass_, counted)
    assert eager_buffer_op(slots, hidden, local, ep, 1, "bwd_weight") is None


def test_experts_launch_per_module_and_carry_their_weight_gradients() -> None:
    """Per-expert modules (our worker, Megatron-core, DeepSpeed) launch each projection and
    activation once per local expert, torchtitan's grouped experts once; the expert
    pass's weight gradients hold, beside the wgrad GEMMs, a bias gradient per biased
    linear and expert and AccumulateGrad over the experts' tensors (2 local experts
    at EP 2: 8 tensors, as the worker builds them)."""
    from simulator.model.inventory.experts import expert_tensors
    from simulator.spec.load import scenario_from_dict
    from simulator.strategies.expert import layer as epar

    def scenario(stack: str) -> Any:
        return scenario_from_dict({
            "name": "t", "model": {**_tiny_moe().model_dump(exclude_none=True),
                                   "preset": None}, "stack": stack,
            "cluster": {"system": "cpu-1thread", "nodes": 1, "gpus_per_node": 2},
            "parallel": {"dp": 2, "ep": 2},
            "training": {"global_batch": 8, "micro_batch": 2, "dtype": "fp32"}})

    eager = scenario("pytorch-eager")
    lay = epar.expert_layer(eager)
    by = {op.name: op for op in lay.fwd}
    assert (by["expert_up"].kernels, by["expert_act"].kernels, by["expert_down"].kernels) \
        == (2, 2, 2)
    assert by["expert_buffers"].kernels == 4  # stack, two transposed copies, the buffer
    weight = {op.name: op for op in lay.bwd_weight}
    assert weight["expert_up"].kernels == 2 and weight["expert_up"].cost_class == "gemm_wgrad"
    assert weight["expert_bias_grad"].kernels == 2 * 2
    assert weight["expert_bias_grad"].bytes == pytest.approx(4 * lay.tokens * (512 + 128))
    assert weight["expert_grad_accum"].kernels == expert_tensors(eager.model, eager.stack,
                                                                 2) == 8
    elements = 2 * (2 * 128 * 512 + 512 + 128)
    assert weight["expert_grad_accum"].bytes == pytest.approx(4 * 3 * elements)
    titan = epar.expert_layer(scenario("torchtitan"))
    assert {op.name: op.kernels for op in titan.fwd} == {
        "expert_up": 1, "expert_act": 1, "expert_down": 1}

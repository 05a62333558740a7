"""A mixture of experts' ops: the routed experts (grouped or one GEMM per local expert),
their weight gradients, the eager routing's buffer copies, and the MoE layer around
them (router, permutations, shared experts).
"""

from __future__ import annotations

from simulator.model.inventory import fp8
from simulator.model.inventory.dense import (
    amp_cast_ops,
    frame,
    grad_ops,
    layer_gemms,
    param_grad_ops,
    weight_elements,
)
from simulator.model.inventory.ops import (
    Op,
    Pass,
    Shape,
    call_shape,
    dtype_bytes,
    gemm,
    mem,
    norm_tensors,
    qkv_linears,
    up_linears,
)
from simulator.model.inventory.tensor_parallel import dtensor
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec


def routed_tokens(spec: ModelSpec, tokens: float, padded: bool) -> float:
    """Token-expert pairs the routed experts compute: k per token dropless; c·k with a
    capacity factor c (every expert's buffer computed whether full or not; model FLOPs,
    ``padded=False``, count min(c, 1)·k, what the model computes for the tokens it
    keeps)."""
    c = spec.capacity_factor
    if c is None:
        return tokens * spec.experts_per_token
    return tokens * spec.experts_per_token * (c if padded else min(c, 1.0))


def grouped_gemm(name: str, m: float, k: float, n: float, groups: int, dt: int, cls: str,
             saved: float = 0.0, calls: int = 1) -> Op:
    """``groups`` GEMMs of (m/groups × k)·(k × n), one weight each, in ``calls`` launches
    (:func:`expert_calls`; the efficiency-curve lookup at one expert's product)."""
    flops = 2.0 * m * k * n
    return Op(name, "gemm", flops, dt * (m * k + groups * k * n + m * n), flops / groups, cls,
              calls, saved, gemm_call=call_shape(m, k, n, cls, calls, groups))


def expert_calls(stack: StackSpec | None, groups: int) -> int:
    """Launches of one projection (or activation) of ``groups`` local routed experts: one
    per expert under ``stack.moe_experts: modules``, whose experts are modules called in
    turn (Megatron-core's SequentialMLP, megatron/core/transformer/moe/experts.py, and
    TEGroupedMLP's GroupedLinear, one GEMM per ``weight{i}``; DeepSpeed's
    deepspeed/moe/experts.py Experts; our calibration/measured/moe_worker.py), one
    grouped call under ``grouped`` (torchtitan/models/moe.py GroupedExperts:
    ``torch._grouped_mm``). Without a stack, one call."""
    return groups if stack is not None and stack.moe_experts == "modules" else 1


def expert_act(spec: ModelSpec, tokens: float, width: float, dt: int, pass_: Pass,
                name: str, kernels: int = 1, kept: float | None = None) -> Op:
    """An expert MLP's activation over ``tokens`` × ``width``: it reads and writes
    (GeLU) 2, (SwiGLU) 3 elements a unit forward, 3 and 5 backward; keeps its input, at
    ``kept`` bytes an element (default the training dtype's; FP8 under DeepSeek-V3's
    caching, :func:`simulator.model.inventory.fp8.expert_act_bytes`)."""
    swiglu = spec.activation == "swiglu"
    factor = (3.0 if swiglu else 2.0) if pass_ == "fwd" else (5.0 if swiglu else 3.0)
    width_kept = dt if kept is None else kept
    keep = (2 if swiglu else 1) * tokens * width * width_kept if pass_ == "fwd" else 0.0
    return mem(name, factor * tokens * width, dt, "elementwise", kernels, keep)


def routed_expert_ops(spec: ModelSpec, tokens: float, width: float, groups: int, dt: int,
                      pass_: Pass, stack: StackSpec | None = None, ep: int = 1) -> list[Op]:
    """The routed experts on ``tokens`` token-expert pairs, forward order: a grouped GEMM
    of ``groups`` experts up (keeping its input, the permuted tokens), the activation,
    a grouped GEMM down (keeping its input); each expert's MLP ``width`` wide (its
    share under expert tensor parallelism), each launched as the stack calls its
    experts (:func:`expert_calls`); under the ``eager`` routing the buffers' reshuffle
    around them at expert parallelism ``ep`` (:func:`eager_buffer_op`)."""
    h = spec.hidden
    up = (2 if spec.activation == "swiglu" else 1) * width
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    calls = expert_calls(stack, groups)
    kb = (1 if fp8.on(stack) else dt) * (pass_ == "fwd")  # bytes kept per input element

    def make(name: str, k: float, n: float, grads: float) -> list[Op]:
        if fp8.on(stack):  # FP8 grouped linears (TE's GroupedLinear), with their casts
            g = fp8.linear(name, tokens, k, n, dt, cls, pass_, calls, kb * tokens * k, groups)
            return fp8.around(stack, name, g, tokens * k / calls, grads, groups * k * n,
                              calls, pass_)
        return [grouped_gemm(name, tokens, k, n, groups, dt, cls, kb * tokens * k, calls)]

    ops = [*make("expert_up", h, up, tokens * up),
           expert_act(spec, tokens, width, dt, pass_, "expert_act", calls,
                      fp8.expert_act_bytes(stack, dt)),
           *make("expert_down", width, h, tokens * h)]
    buffers = eager_buffer_op(tokens, h, groups, ep, dt, pass_) \
        if stack is not None and stack.moe_routing == "eager" else None
    return ops if buffers is None else [*ops, buffers]


def expert_weight_ops(spec: ModelSpec, stack: StackSpec, tokens: float, width: float,
                      groups: int, dt: int) -> list[Op]:
    """The routed experts' parameter-gradient ops besides their wgrad GEMMs, on one rank's
    ``groups`` local experts over ``tokens`` token-expert pairs, as :func:`grad_ops`
    has them for a layer's own tensors (:func:`param_grad_ops`): ``bias_grad`` (one
    reduction of dY per biased linear and call), under autocast ``amp_weight_cast``, and
    ``grad_accum``
    (AccumulateGrad's add, one kernel per tensor, :func:`expert_tensors`) or, with fp32
    main grads, the wgrad epilogue's ``main_grad`` read-modify-write (names prefixed
    ``expert_``)."""
    h, linears = spec.hidden, up_linears(spec, stack) + 1
    up = (2 if spec.activation == "swiglu" else 1) * width
    weights = groups * (h * up + width * h)
    biases = groups * (up + h) if spec.bias else 0.0
    calls, tensors = expert_calls(stack, groups), expert_tensors(spec, stack, groups)
    bias, accum = param_grad_ops(spec, stack, dt, "expert_", tokens * (up + h),
                                  calls * linears, weights, weights + biases,
                                  weights + biases, tensors, tensors)
    return [*bias, *accum]


#: Kernels of the ``eager`` routing (``stack.moe_routing``) as our measured MoE worker
#: launches them (calibration/measured/moe_worker.py ``MoEMLP.forward``, each op counted in
#: the profile of its tiny-gpt EP 2 run), on the rank's own tokens: into the buffers, 21
#: before the dispatch (softmax, topk, sum, div, one_hot, cumsum, sub, mul, sum, lt, mul,
#: clamp, add, arange, repeat_interleave, new_zeros, three index, index_copy, empty_like);
#: back home, 4 after the combine (mul, index, mul, sum). Backward, their autograd nodes:
#: 10 for the way in (index_copy, index, div, sum, topk and softmax backward and the
#: gradients' sums) and 7 for the way back (sum, two mul and index backward). Per pass:
#: (permute, unpermute). The buffers' reshuffle around the experts is
#: :func:`eager_buffer_op`'s.
EAGER_ROUTING = {"fwd": (21, 4), "bwd_input": (10, 7)}


def eager_routing_rows(pass_: Pass, tokens: float, slots: float,
                       pairs: float) -> tuple[float, float]:
    """Rows of ``hidden`` elements the ``eager`` routing (:data:`EAGER_ROUTING`) reads and
    writes on the rank's own tokens, (permute, unpermute), over ``tokens`` tokens (T),
    ``slots`` expert-buffer slots (S = E·C) and ``pairs`` routed token-expert pairs
    (P = k·T), op by op as calibration/measured/moe_worker.py ``MoEMLP.forward`` runs
    them and autograd differentiates them, each op's inputs read and outputs written
    (the router's and the masks' own traffic, a few elements a token, left out).
    Forward, into the buffers: ``new_zeros`` (S), the gather ``tokens[source]``
    (T + P), ``index_copy`` (2S + P); back home: ``out[slot]`` (S + P), the gate's
    multiply (2P), the sum over k (P + T). Backward, back home: the multiply's two
    gradients (5P) and their sums (2P + T), ``out[slot]``'s index_put into a zeroed
    buffer (3S + P), a copy of the pairs (2P); the way in: ``index_copy``'s
    index_select (S + P), the gather's index_put into zeroed tokens (3T + P), the
    token gradient's sum with the router's (3T). Counted under a dispatch mode in
    tests/test_moe.py. Other passes (and a fused routing): one read and write of the
    tokens and slots."""
    if pass_ == "fwd":
        return 3 * slots + 2 * pairs + tokens, slots + 4 * pairs + tokens
    if pass_ == "bwd_input":
        return slots + 2 * pairs + 6 * tokens, 3 * slots + 10 * pairs + tokens
    return tokens + slots, slots + tokens


def eager_buffer_op(slots: float, hidden: int, local: int, ep: int, dt: int,
                    pass_: Pass) -> Op | None:
    """The ``eager`` routing's reshuffle of the experts' buffers on an EP rank holding
    ``local`` experts, over its ``slots`` received slots (ep · C per expert) of
    ``hidden`` elements, as
    calibration/measured/moe_worker.py ``MoEMLP.forward`` runs it: with EP, the received
    buffer's transposed copy into expert-major order and the returned buffer's copy
    back (2S each) and the exchange's second output buffer; ``torch.stack`` of the
    experts' outputs (2S). Backward: ``stack``'s gradient is one ``select_backward`` per
    expert (a zeroed S-slot buffer with the expert's slots copied in, S + S/local each)
    summed by autograd ((local − 1) adds of 3S), and with EP the two copies' gradients
    (4S). Priced with the experts (the expert pass), none in the weight pass."""
    exchanged = 1 if ep > 1 else 0
    if pass_ == "fwd":
        rows, kernels = (2 + 4 * exchanged) * slots, 1 + 3 * exchanged
    elif pass_ == "bwd_input":
        rows = ((local + 1) + 3 * (local - 1) + 4 * exchanged) * slots
        kernels = 2 * local - 1 + 2 * exchanged
    else:
        return None
    return Op("expert_buffers", "memory", 0.0, dt * rows * hidden, 0.0, "copy", kernels)


def moe_mlp(x: Shape, pass_: Pass, padded: bool) -> list[Op]:
    """A MoE layer's MLP block in forward order: the router (replicated over TP; keeps
    its input, the normed tokens every branch reads, and its fp32 probabilities), the
    permutation into the experts' buffers, the shared experts as one MLP of width
    shared · f_e (Megatron-LM's fused shared experts), the routed experts, and the
    weighted un-permutation (copies of k·T·h elements)."""
    spec, T, h, dt = x.spec, x.tokens, x.spec.hidden, x.dt
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    keep = pass_ == "fwd"
    routed = routed_tokens(spec, T, padded)
    f = spec.expert_ffn / x.tp
    eager = x.st.moe_routing == "eager"
    into, back = EAGER_ROUTING.get(pass_, (1, 1)) if eager else (1, 1)
    rows_in, rows_back = eager_routing_rows(pass_, T, routed, routed_tokens(spec, T, False)) \
        if eager else (T + routed, routed + T)
    rows = x.kept_in  # under SP Megatron routes its shard, a DTensor MoE the gathered tokens
    ops = [gemm("router", rows, h, spec.experts, dt, cls, 1,
                (dt * rows * h + 4 * rows * spec.experts) * keep),
           mem("permute", rows_in * h, dt, "elementwise", into)]
    if spec.shared_experts:
        width = spec.shared_experts * f
        up = (2 if spec.activation == "swiglu" else 1) * width
        ops += [gemm("shared_up", T, h, up, dt, cls),
                expert_act(spec, T, width, dt, pass_, "shared_act"),
                gemm("shared_down", T, width, h, dt, cls, 1, dt * T * width * keep)]
    return [*ops, *routed_expert_ops(spec, routed, f, spec.experts, dt, pass_, x.st),
            mem("unpermute", rows_back * h, dt, "elementwise", back)]


def moe_mlp_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                dtype: str, pass_: Pass, stack: StackSpec, padded: bool = True) -> list[Op]:
    """A MoE layer's MLP block on one TP rank, forward order (:func:`moe_mlp`): what a
    latent-attention model's MoE layers (:func:`simulator.model.moe.layer_ops`) run too."""
    x = Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return moe_mlp(x, pass_, padded)


def moe_layer_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                  dtype: str, pass_: Pass, stack: StackSpec, padded: bool = True,
                  ) -> tuple[Op, ...]:
    """A routed-experts layer (standard attention) on one TP rank, in execution order:
    the dense layer's frame as the stack runs it (norms, projections, attention,
    residuals, their gradient sums, casts and DTensor dispatch) with the MLP replaced by
    :func:`moe_mlp`. The routed experts' ops are here for the layer's FLOPs and what
    it keeps; the workload takes them out and the expert pass prices them on the ranks
    that hold the experts (:func:`simulator.strategies.expert_parallel.expert_layer`)."""
    x = Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return dtensor(x, _moe_layer_ops(x, pass_, padded))


def _moe_layer_ops(x: Shape, pass_: Pass, padded: bool) -> tuple[Op, ...]:
    g = layer_gemms(x, pass_)
    mlp = moe_mlp(x, pass_, padded)
    if pass_ == "bwd_weight":  # the routed experts' own weight-gradient ops last
        experts = expert_weight_ops(x.spec, x.st, routed_tokens(x.spec, x.tokens, padded),
                                    x.spec.expert_ffn / x.tp, x.spec.experts, x.dt)
        return (g["qkv"], g["out_proj"], *(op for op in mlp if op.kind == "gemm"),
                *_moe_weight_ops(x), *experts)
    readers = 2 + (1 if x.spec.shared_experts else 0)  # router, permutation, shared experts
    return frame(x, pass_, g, [*amp_cast_ops(x, "amp_cast_up", 1, pass_), *mlp], readers)


def _moe_weight_ops(x: Shape) -> list[Op]:
    """As :func:`weight_ops` for the layer's own parameters: the attention's, the
    norms', the router's and the shared experts'. The routed experts' gradients are the
    expert pass's (their ranks hold them)."""
    spec, T, L, h = x.spec, x.tokens, x.local, x.spec.hidden
    f = spec.shared_experts * spec.expert_ffn / x.tp
    up = (2 if spec.activation == "swiglu" else 1) * f
    shared = 1 if spec.shared_experts else 0
    weights = weight_elements(x, "qkv") + weight_elements(x, "out_proj") \
        + h * spec.experts + shared * (h * up + f * h)
    tensors = moe_layer_tensors(spec, x.st)
    return grad_ops(x, T * (x.q + 2 * x.kv) + L * h + shared * (T * up + L * h),
                     x.qkv_kernels + 1 + 2 * shared, weights, weights, tensors, tensors)


def moe_layer_tensors(spec: ModelSpec, stack: StackSpec) -> int:
    """A MoE layer's own parameter tensors: the attention's linears, the norms, the
    router (its weight, and DeepSeek's expert bias under a sigmoid router) and the
    shared experts' MLP (one module of two linears, as Megatron-core's SharedExpertMLP
    and DeepSeek-V3's ``shared_experts`` hold them); the routed experts are
    :func:`expert_tensors`."""
    shared = 1 if spec.shared_experts else 0
    router = 1 + (1 if spec.router == "sigmoid" else 0)
    return (qkv_linears(stack) + 1 + 2 * shared) * (2 if spec.bias else 1) + router \
        + 2 * norm_tensors(spec)


def expert_tensors(spec: ModelSpec, stack: StackSpec, local_experts: int) -> int:
    """Parameter tensors of one MoE layer's ``local_experts`` routed experts on a rank:
    under ``stack.moe_experts: modules`` one MLP module per expert (its up, or gate and
    up, and down linears with their biases), under ``grouped`` one tensor per projection
    for all of them (torchtitan's GroupedExperts: w1, w2, w3)."""
    if local_experts <= 0:
        return 0
    linears = up_linears(spec, stack) + 1
    if stack.moe_experts == "grouped":
        return linears
    return local_experts * linears * (2 if spec.bias else 1)

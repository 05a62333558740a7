"""The kernel-level op inventory of a dense transformer layer, its ends and the optimizer.

Derived from model + stack (:class:`simulator.spec.stack.StackSpec`): every forward,
backward-input, backward-weight and recompute op of one micro-batch on one TP rank,
each an :class:`Op` with its FLOPs, HBM bytes read and written, its cost class, how
many kernels it launches and the bytes it keeps for backward. The same records price
the step (:mod:`simulator.system.costs`) and size the stored activations
(:func:`kept_for_backward`, read by :mod:`simulator.model.memory`), so compute and memory
always describe one program. docs/model.md lists every op with its formula.

The layer, in execution order (T = b·s tokens, L = T/t with sequence parallelism else
T, widths per TP rank: q = h/t, kv = KV heads/t · head_dim, f = ffn/t):

- ``ln1``, ``ln2``: a norm kernel over L·h; keeps its input.
- ``qkv``: one GEMM, or three with separate q/k/v projections; keeps its input (the
  sharded one under sequence parallelism, which Megatron re-gathers in backward; under
  ``stack.sp_input_backward: saved``, DTensor's, the all-gathered one, T·h).
- ``rope`` (rotary models): one fused kernel, or the eager rotate-half sequence.
- attention: with ``flash2``/``flash3`` one ``attn_core`` kernel that keeps Q, K, V and
  the softmax statistics and, under a causal mask, executes half the counted FLOPs
  (masked blocks are skipped); unfused: ``attn_scores`` (baddbmm QKᵀ, writes the s×s
  scores), ``attn_softmax`` (fused scale-mask-softmax, or mask and softmax apart),
  ``attn_dropout`` and ``attn_av`` (bmm), which keep Q and K, the softmax output, the
  dropout mask and output, and V (Korthikanti et al. 2022, Table 2: 5·a·s²·b).
- ``out_proj``, ``mlp_up``, ``mlp_down``: GEMMs, each keeping its input.
- ``act``: GeLU (with its bias when fused) or SwiGLU; keeps its input.
- ``residual``: bias, dropout and residual add (one kernel when fused); keeps the
  1-byte dropout mask.
- backward only: ``grad_sum`` where the residual stream forks into a norm (autograd
  adds the two gradients), one per norm; ``qkv_grad_sum`` / ``up_grad_sum`` where
  separate q, k, v (or gate and up) projections read the same normed input.
- backward weight: the wgrad GEMMs (writing, or with fp32 main grads read-modify-writing
  the fp32 ``main_grad``), ``bias_grad`` reductions of dY, ``norm_grad`` (the γ/β
  partial sums), and ``grad_accum`` (AccumulateGrad's add of 16-bit grads).

FLOPs count matrix multiplies only (2·M·N·K), so the counted FLOPs of a layer do not
depend on the stack; what the GPU executes does (``compute_scale``).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.model.inventory import fp8
from simulator.model.inventory.attention import attention_ops, qkv_split_ops, rope_ops
from simulator.model.inventory.ops import (
    TORCH_GELU_FP32_FLOPS,
    Op,
    Pass,
    Shape,
    dense_layer_tensors,
    dtype_bytes,
    gemm,
    mem,
    norm_elements,
    norm_tensors,
    qkv_linears,
    up_linears,
)
from simulator.model.inventory.tensor_parallel import dtensor
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec


def layer_gemms(x: Shape, pass_: Pass) -> dict[str, Op]:
    """The layer's four linears; under ``stack.fp8`` FP8 GEMMs that keep their FP8 input
    (1 byte an element; the out-projection's in E5M6 under DeepSeek-V3's caching,
    :func:`simulator.model.inventory.fp8.attn_out_bytes`)."""
    h, T, dt = x.spec.hidden, x.tokens, x.dt
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    kb = (1 if fp8.active(x) else dt) * (pass_ == "fwd")  # bytes kept per input element

    def make(name: str, k: float, n: float, kernels: int, kept: float) -> Op:
        if fp8.active(x):
            return fp8.linear(name, T, k, n, dt, cls, pass_, kernels, kept)
        return gemm(name, T, k, n, dt, cls, kernels, kept)

    return {
        "qkv": make("qkv", h, x.q + 2 * x.kv, x.qkv_kernels, kb * x.kept_in * h),
        "out_proj": make("out_proj", x.q, h, 1,
                         fp8.attn_out_bytes(x.st, dt) * (pass_ == "fwd") * T * x.q),
        "mlp_up": make("mlp_up", h, x.up, x.up_kernels, kb * x.kept_in * h),
        "mlp_down": make("mlp_down", x.spec.ffn / x.tp, h, 1, kb * T * x.spec.ffn / x.tp),
    }


def with_casts(x: Shape, g: dict[str, Op], name: str, pass_: Pass) -> list[Op]:
    """Linear ``name`` of ``g`` with its FP8 casts around it (none without ``stack.fp8``):
    its input (the local shard under sequence parallelism), its output gradient and, cast
    every micro-batch, its weight."""
    if not fp8.active(x):  # every layer of every bf16 run comes here
        return [g[name]]
    h, T, L, f = x.spec.hidden, x.tokens, x.local, x.spec.ffn / x.tp
    inputs, grads, linears = {"qkv": (L * h, T * (x.q + 2 * x.kv), x.qkv_kernels),
                              "out_proj": (T * x.q, L * h, 1),
                              "mlp_up": (L * h, T * x.up, x.up_kernels),
                              "mlp_down": (T * f, L * h, 1)}[name]
    return fp8.around(x.st, name, g[name], inputs, grads, weight_elements(x, name), linears,
                      pass_)


def weight_elements(x: Shape, name: str) -> float:
    h, f = x.spec.hidden, x.spec.ffn / x.tp
    return {"qkv": h * (x.q + 2 * x.kv), "out_proj": x.q * h, "mlp_up": h * x.up,
            "mlp_down": f * h}[name]


def act_op(x: Shape, pass_: Pass) -> Op:
    T, f, dt = x.tokens, x.spec.ffn / x.tp, x.dt
    fused, bias = x.st.fused("bias_act"), x.spec.bias
    if x.spec.activation == "swiglu":
        if pass_ == "fwd":  # kept: gate and up; unfused also SiLU's output, which the mul
            # keeps for up's gradient (tools/autograd/derivatives.yaml: silu saves self,
            # mul.Tensor saves self and other)
            return mem("act", (3 if fused else 5) * T * f, dt, "elementwise", 1 if fused else 2,
                       dt * (2 if fused else 3) * T * f)
        return mem("act", (5 if fused else 8) * T * f, dt, "elementwise", 1 if fused else 3)
    # a separate bias-add kernel (read + write) unless fused here or inside the GEMM (addmm)
    extra = 0 if fused or not bias or x.st.fused("bias_gemm") else 1
    # unfused, the GeLU is PyTorch's own F.gelu, bound by its erf on some GPUs
    alu = 0.0 if fused else TORCH_GELU_FP32_FLOPS * T * f
    if pass_ == "fwd":
        op = mem("act", (2 + 2 * extra) * T * f, dt, "elementwise", 1 + extra, dt * T * f)
    else:
        op = mem("act", 3 * T * f, dt, "elementwise")
    return replace(op, alu_flops=alu)


def residual_ops(x: Shape, pass_: Pass) -> list[Op]:
    """Bias, dropout and residual add after the out-proj and after the MLP."""
    E, dt = x.local * x.spec.hidden, x.dt
    dropout = x.st.hidden_dropout > 0
    bias = x.spec.bias and not x.st.fused("bias_gemm")  # addmm adds it inside the GEMM
    if pass_ == "bwd_input":  # the add passes gradients through; dropout scales by its mask
        ops = [Op("residual", "memory", 0.0, (2 * dt + 1) * E, 0.0, "elementwise")] \
            if dropout else []
        if x.st.amp(dt):  # autocast: the fp32 stream's gradient cast to the 16-bit branch's
            ops.insert(0, mem("amp_cast_residual", E, x.rs + dt, "copy"))
        return ops
    mask = E if dropout else 0.0
    add = (2 * x.rs + dt) * E  # the stream read and written, the branch read
    if x.st.fused("bias_dropout_add"):
        return [Op("residual", "memory", 0.0, add + mask, 0.0, "elementwise", 1, mask)]
    kernels = 1 + bias + dropout  # bias add, dropout, add: read + write each, the add reads 2
    nbytes = add + 2 * dt * E * (bias + dropout) + mask
    return [Op("residual", "memory", 0.0, nbytes, 0.0, "elementwise", kernels, mask)]


def norm_op(x: Shape, name: str, pass_: Pass) -> Op:
    elements = norm_elements(x.spec, x.local, pass_)
    return mem(name, elements, x.rs, x.st.norm_classes[0], 1,
               x.rs * x.local * x.spec.hidden * (pass_ == "fwd"))


def amp_cast_ops(x: Shape, name: str, linears: int, pass_: Pass) -> list[Op]:
    """Autocast casts each linear's fp32 input (a norm's output) to the training dtype,
    one copy per linear; the backward casts each input gradient back to fp32
    (``ToCopyBackward0``). The forward's weight casts are cached for the autocast
    region, one per step, and left out."""
    if not x.st.amp(x.dt) or pass_ == "bwd_weight":
        return []
    return [mem(name, linears * x.tokens * x.spec.hidden, x.rs + x.dt, "copy", linears)]


def weight_ops(x: Shape) -> list[Op]:
    """Bias and norm-parameter gradients, and AccumulateGrad for 16-bit grads."""
    T, L, h = x.tokens, x.local, x.spec.hidden
    weights = sum(weight_elements(x, n) for n in ("qkv", "out_proj", "mlp_up", "mlp_down"))
    linears = qkv_linears(x.st) + 1 + up_linears(x.spec, x.st) + 1
    biased = x.spec.bias
    return grad_ops(x, T * (x.q + 2 * x.kv) + T * x.up + 2 * L * h,
                     x.qkv_kernels + x.up_kernels + 2, weights,
                     weights + (x.q + 2 * x.kv + h + x.up + h if biased else 0.0),
                     linears * (2 if biased else 1), dense_layer_tensors(x.spec, x.st))


def grad_ops(x: Shape, bias_elements: float, bias_kernels: int, weights: float,
              cast_elements: float, cast_kernels: int, tensors: int) -> list[Op]:
    """A layer's own parameter-gradient ops besides the wgrad GEMMs: ``bias_grad`` (dbias
    = Σ_tokens dY over ``bias_elements``, one reduction per biased linear), ``norm_grad``
    (γ and β partial sums, then the sum), under autocast ``amp_weight_cast`` (each
    16-bit gradient cast to its fp32 parameter's), and ``grad_accum`` (AccumulateGrad's
    add over ``weights`` in ``tensors`` kernels) or, with fp32 main grads, ``main_grad``."""
    L, h, dt = x.local, x.spec.hidden, x.dt
    bias, accum = param_grad_ops(x.spec, x.st, dt, "", bias_elements, bias_kernels, weights,
                                  weights, cast_elements, cast_kernels, tensors)
    return [*bias, mem("norm_grad", 2 * 2 * L * h, dt, x.st.norm_classes[1],
                       2 * norm_tensors(x.spec)),
            *accum]


def param_grad_ops(spec: ModelSpec, stack: StackSpec, dt: int, prefix: str,
                    bias_elements: float, bias_kernels: int, weights: float,
                    accum_elements: float, cast_elements: float, cast_kernels: int,
                    tensors: int) -> tuple[list[Op], list[Op]]:
    """The parameter-gradient ops of :func:`grad_ops` and :func:`expert_weight_ops`
    (named with ``prefix``): the bias gradients; then under autocast the casts, and
    AccumulateGrad's add over ``accum_elements`` or the fused fp32 main grads' traffic
    (none where FSDP mixed precision keeps them: ``StackSpec.fused_main_grads``)."""
    bias = [mem(f"{prefix}bias_grad", bias_elements, dt, "reduction", bias_kernels)] \
        if spec.bias else []
    accum: list[Op] = []
    if stack.amp(dt):
        accum.append(mem(f"{prefix}amp_weight_cast", cast_elements, dt + 4, "copy",
                         cast_kernels))
    if stack.main_grads == "param":  # AccumulateGrad adds each micro-batch's grads
        accum.append(mem(f"{prefix}grad_accum", 3 * accum_elements,
                         4 if stack.amp(dt) else dt, "elementwise", tensors))
    elif stack.fused_main_grads(dt):  # the wgrad GEMMs read-modify-write the fp32 main_grad
        # in their epilogue (gradient_accumulation_fusion): 8 bytes per weight instead of the
        # 16-bit write (under FSDP mixed precision FSDP's own kernels: fsdp_reduce_parts)
        accum.append(Op(f"{prefix}main_grad", "memory", 0.0, (8 - dt) * weights, 0.0,
                        "elementwise", 0))
    return bias, accum


def dense_layer_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                    dtype: str, pass_: Pass, stack: StackSpec) -> tuple[Op, ...]:
    """One dense layer's ops on one TP rank, in execution order."""
    x = Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return dtensor(x, _dense_layer_ops(x, pass_))


def _dense_layer_ops(x: Shape, pass_: Pass) -> tuple[Op, ...]:
    g = layer_gemms(x, pass_)
    if pass_ == "bwd_weight":
        return (*g.values(), *weight_ops(x))
    return frame(x, pass_, g, [*amp_cast_ops(x, "amp_cast_up", x.up_kernels, pass_),
                                *with_casts(x, g, "mlp_up", pass_), act_op(x, pass_),
                                *with_casts(x, g, "mlp_down", pass_)], x.up_kernels)


def frame(x: Shape, pass_: Pass, g: dict[str, Op], mlp: list[Op],
           readers: int) -> tuple[Op, ...]:
    """A layer in execution order around its MLP block ``mlp`` (forward order), whose
    ``readers`` projections read the normed input: the norms, the attention as the stack
    runs it, the residuals and, backward, the gradient sums where the stream forks."""
    grad_sum = [mem("grad_sum", 3 * x.local * x.spec.hidden, x.rs, "elementwise")] \
        if pass_ == "bwd_input" else []
    ops = (*grad_sum, norm_op(x, "ln1", pass_),
           *fork_grad_sum(x, "qkv_grad_sum", x.qkv_kernels, pass_),
           *amp_cast_ops(x, "amp_cast_qkv", x.qkv_kernels, pass_),
           *with_casts(x, g, "qkv", pass_), *qkv_split_ops(x, pass_), *rope_ops(x, pass_),
           *attention_ops(x, pass_),
           *with_casts(x, g, "out_proj", pass_), *residual_ops(x, pass_), *grad_sum,
           norm_op(x, "ln2", pass_), *fork_grad_sum(x, "up_grad_sum", readers, pass_), *mlp,
           *residual_ops(x, pass_))
    if fp8.active(x):  # delayed scaling's update, after the pass
        linears = sum(op.kernels for op in ops if op.precision == "fp8")
        ops = (*ops, *fp8.scale_update(x, linears, pass_))
    return ops if pass_ == "fwd" else ops[::-1]


def fork_grad_sum(x: Shape, name: str, gemms: int, pass_: Pass) -> list[Op]:
    """Separate projections reading the same normed input (q, k and v; SwiGLU's gate and
    up): autograd adds their input gradients (one add over T·h per extra GEMM) before
    the norm's backward."""
    if pass_ != "bwd_input" or gemms == 1:
        return []
    adds = gemms - 1  # under autocast the gradients were cast back to fp32 first
    return [mem(name, 3 * adds * x.tokens * x.spec.hidden, x.rs, "elementwise", adds)]


# ---------------------------------------------------------------- a mixture of experts

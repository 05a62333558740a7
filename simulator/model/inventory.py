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
  sharded one under sequence parallelism, which Megatron re-gathers in backward).
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

import math
from dataclasses import dataclass, replace
from typing import Literal

from simulator.spec.scenario import ModelSpec
from simulator.spec.stack import StackSpec
from simulator.system.hardware import CollectiveName

OpKind = Literal["gemm", "attention", "memory"]
Pass = Literal["fwd", "bwd_input", "bwd_weight"]
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: the ops inside the attention core (what selective recomputation re-runs)
CORE_OPS = ("attn_core", "attn_scores", "attn_softmax", "attn_dropout", "attn_av")
FLASH_BWD_KERNELS = {"flash2": 3, "flash3": 2}  # dO·O preprocess, main kernel(, dQ convert)


#: Executed / counted FLOPs of a causal flash-attention kernel: it skips the blocks above
#: the diagonal (FlashAttention-2, Dao 2023, §3.1.1). Efficiencies of such kernels are
#: quoted against the executed FLOPs (flash-attn's benchmarks/benchmark_flash_attention.py
#: halves its FLOP count when causal), and calibration fits them the same way
#: (calibration/microbench/fit_terms.py ``executed_peak``).
CAUSAL_FLASH_SCALE = 0.5

@dataclass(frozen=True)
class Op:
    """One kernel (group) of one micro-batch on one TP rank."""

    name: str  # "ln1", "qkv", "attn_core", "out_proj", "residual", "logits", ...
    kind: OpKind  # gemm / attention are FLOP-bound; memory is bandwidth-bound
    flops: float  # counted FLOPs on one TP rank, for one micro-batch
    bytes: float  # HBM bytes read + written on one TP rank
    gemm_flops: float  # FLOPs of the single underlying call (efficiency-curve lookup)
    cls: str = ""  # cost class (gemm_fwd, attention_bwd, softmax, norm, ...); "" = by kind
    kernels: int = 1  # kernel launches
    saved: float = 0.0  # bytes this forward op keeps for the backward
    compute_scale: float = 1.0  # executed / counted FLOPs (CAUSAL_FLASH_SCALE: skipped blocks)
    dtensor: int = 0  # of its kernels, those dispatched on DTensor operands (TP as DTensor)
    #: what the host pays for, in units of the per-kernel host cost: one a kernel unless
    #: set (a foreach optimizer's host work is per tensor, its launches per chunk)
    host_units: int | None = None

    @property
    def host_ops(self) -> int:
        """Units of host work (``host_units``, else one per kernel)."""
        return self.kernels if self.host_units is None else self.host_units

    @property
    def cost_class(self) -> str:
        if self.cls:
            return self.cls
        return {"gemm": "gemm_fwd", "attention": "attention_fwd"}.get(self.kind, "elementwise")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element: bf16/fp16 2, fp32 4."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPE_BYTES)}") from None


def gemm(name: str, m: float, k: float, n: float, dt: int, cls: str = "", kernels: int = 1,
         saved: float = 0.0) -> Op:
    """An (m×k)·(k×n) product in ``kernels`` equal calls; its dgrad and wgrad read and
    write the same three shapes."""
    flops = 2.0 * m * k * n
    return Op(name, "gemm", flops, dt * (m * k + k * n + m * n), flops / kernels, cls, kernels,
              saved)


def mem(name: str, elements: float, dt: int, cls: str = "", kernels: int = 1,
        saved: float = 0.0) -> Op:
    return Op(name, "memory", 0.0, dt * elements, 0.0, cls, kernels, saved)


def kv_per_rank(spec: ModelSpec, tp: int) -> float:
    return max(spec.kv / tp, 1.0)  # replicated when tp > kv_heads


def norm_elements(spec: ModelSpec, tokens: float, pass_: Pass) -> float:
    # forward reads x, writes y; backward reads x and dy, writes dx (stats are tiny)
    return (2.0 if pass_ == "fwd" else 3.0) * tokens * spec.hidden


def act_elements(spec: ModelSpec, tokens: float, tp: int, pass_: Pass) -> float:
    f = spec.ffn / tp
    if spec.activation == "swiglu":  # fwd: gate, up -> out; bwd: gate, up, dy -> dgate, dup
        return (3.0 if pass_ == "fwd" else 5.0) * tokens * f
    return (2.0 if pass_ == "fwd" else 3.0) * tokens * f  # gelu: x -> y; x, dy -> dx


def qkv_linears(stack: StackSpec) -> int:
    """The attention's input projections: one QKV GEMM, or separate q, k and v."""
    return 1 if stack.fused("projections") else 3


def up_linears(spec: ModelSpec, stack: StackSpec) -> int:
    """The MLP's input projections: up, or separate gate and up of a gated MLP."""
    return 2 if spec.activation == "swiglu" and not stack.fused("projections") else 1


def norm_tensors(spec: ModelSpec) -> int:
    """Parameter tensors of one norm: γ and β of a LayerNorm, γ of an RMSNorm."""
    return 2 if spec.norm == "layernorm" else 1


@dataclass(frozen=True)
class _Shape:
    """One layer on one TP rank for one micro-batch."""

    spec: ModelSpec
    b: int
    tp: int
    sp: bool
    dt: int
    st: StackSpec

    @property
    def tokens(self) -> float:
        return float(self.b * self.spec.seq_len)

    @property
    def local(self) -> float:  # tokens of norms, residuals and dropouts on this rank
        return self.tokens / self.tp if self.sp else self.tokens

    @property
    def q(self) -> float:
        return self.spec.hidden / self.tp

    @property
    def kv(self) -> float:
        return kv_per_rank(self.spec, self.tp) * self.spec.head_dim

    @property
    def scores(self) -> float:  # elements of the s×s matrices of this rank's heads
        return self.b * (self.spec.heads / self.tp) * float(self.spec.seq_len) ** 2

    @property
    def up(self) -> float:
        return (2 if self.spec.activation == "swiglu" else 1) * self.spec.ffn / self.tp

    @property
    def up_kernels(self) -> int:
        return up_linears(self.spec, self.st)

    @property
    def qkv_kernels(self) -> int:
        return qkv_linears(self.st)

    @property
    def rs(self) -> int:
        """Bytes of a residual-stream element: fp32 under autocast (norms run in fp32 and
        the 16-bit branch adds into the fp32 stream), else the training dtype's."""
        return self.st.fp32_under_amp(self.dt)


def _gemms(x: _Shape, pass_: Pass) -> dict[str, Op]:
    h, T, L, dt = x.spec.hidden, x.tokens, x.local, x.dt
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    keep = pass_ == "fwd"
    out = {
        "qkv": gemm("qkv", T, h, x.q + 2 * x.kv, dt, cls, x.qkv_kernels, dt * L * h * keep),
        "out_proj": gemm("out_proj", T, x.q, h, dt, cls, 1, dt * T * x.q * keep),
        "mlp_up": gemm("mlp_up", T, h, x.up, dt, cls, x.up_kernels, dt * L * h * keep),
        "mlp_down": gemm("mlp_down", T, x.spec.ffn / x.tp, h, dt, cls, 1,
                         dt * T * x.spec.ffn / x.tp * keep),
    }
    return out


def _weight_elements(x: _Shape, name: str) -> float:
    h, f = x.spec.hidden, x.spec.ffn / x.tp
    return {"qkv": h * (x.q + 2 * x.kv), "out_proj": x.q * h, "mlp_up": h * x.up,
            "mlp_down": f * h}[name]


def _attention(x: _Shape, pass_: Pass) -> list[Op]:
    """The attention core: one flash kernel, or the unfused sequence."""
    T, dt, S = x.tokens, x.dt, x.scores
    fwd_flops = 4.0 * x.b * x.spec.seq_len ** 2 * x.q  # QKᵀ and AV, the full square
    heads = x.spec.heads / x.tp
    if x.st.flash:
        if pass_ == "fwd":  # read q, k, v; write o; keep q, k, v and the fp32 log-sum-exp
            return [Op("attn_core", "attention", fwd_flops, dt * T * (2 * x.q + 2 * x.kv),
                       fwd_flops, "attention_fwd", 1,
                       dt * T * (x.q + 2 * x.kv) + 4 * T * heads, CAUSAL_FLASH_SCALE)]
        return [Op("attn_core", "attention", 2 * fwd_flops, dt * T * (4 * x.q + 4 * x.kv),
                   2 * fwd_flops, "attention_bwd", FLASH_BWD_KERNELS[x.st.attention], 0.0,
                   CAUSAL_FLASH_SCALE)]
    fused_softmax = x.st.attention == "unfused_fused_softmax"
    dropout = x.st.attention_dropout > 0
    half = fwd_flops / 2
    if pass_ == "fwd":
        ops = [Op("attn_scores", "gemm", half, dt * (T * (x.q + x.kv) + S), half, "gemm_fwd",
                  1, dt * T * (x.q + x.kv)),
               mem("attn_softmax", (2 if fused_softmax else 4) * S, dt, "softmax",
                   1 if fused_softmax else 2, dt * S)]
        if dropout:  # read p, write p' and the 1-byte mask; keep both
            ops.append(Op("attn_dropout", "memory", 0.0, (2 * dt + 1) * S, 0.0, "elementwise",
                          1, (dt + 1) * S))
        ops.append(Op("attn_av", "gemm", half, dt * (S + T * (x.kv + x.q)), half, "gemm_fwd",
                      1, dt * T * x.kv))
        return ops
    # backward in forward order (the caller reverses): dQ, dK from dS; dS from dP; dP, dV
    ops = [Op("attn_scores", "gemm", fwd_flops, dt * (2 * S + 2 * T * (x.q + x.kv)), half,
              "gemm_dgrad", 2),
           mem("attn_softmax", 3 * S, dt, "softmax", 1 if fused_softmax else 2)]
    if dropout:
        ops.append(Op("attn_dropout", "memory", 0.0, (2 * dt + 1) * S, 0.0, "elementwise"))
    ops.append(Op("attn_av", "gemm", fwd_flops, dt * (2 * S + 2 * T * (x.q + x.kv)), half,
                  "gemm_dgrad", 2))
    return ops


def _rope(x: _Shape, pass_: Pass) -> list[Op]:
    """Rotary embedding on q and k: one fused kernel each, or the eager sequence
    (slice, neg, cat, two muls, add: ~6 passes over the tensor, 5 kernels)."""
    if x.spec.position != "rope" or pass_ == "bwd_weight":
        return []
    elements = x.tokens * (x.q + x.kv)
    if x.st.fused("rope"):
        return [mem("rope", 2 * elements, x.dt, "elementwise", 2)]
    return [mem("rope", 12 * elements, x.dt, "elementwise", 10)]


def _act(x: _Shape, pass_: Pass) -> Op:
    T, f, dt = x.tokens, x.spec.ffn / x.tp, x.dt
    fused, bias = x.st.fused("bias_act"), x.spec.bias
    if x.spec.activation == "swiglu":
        if pass_ == "fwd":
            return mem("act", (3 if fused else 5) * T * f, dt, "elementwise", 1 if fused else 2,
                       dt * 2 * T * f)
        return mem("act", (5 if fused else 8) * T * f, dt, "elementwise", 1 if fused else 3)
    # a separate bias-add kernel (read + write) unless fused here or inside the GEMM (addmm)
    extra = 0 if fused or not bias or x.st.fused("bias_gemm") else 1
    if pass_ == "fwd":
        return mem("act", (2 + 2 * extra) * T * f, dt, "elementwise", 1 + extra, dt * T * f)
    return mem("act", 3 * T * f, dt, "elementwise")


def _residual(x: _Shape, pass_: Pass) -> list[Op]:
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


def _norm(x: _Shape, name: str, pass_: Pass) -> Op:
    elements = norm_elements(x.spec, x.local, pass_)
    return mem(name, elements, x.rs, "norm", 1, x.rs * x.local * x.spec.hidden * (pass_ == "fwd"))


def _amp_cast(x: _Shape, name: str, linears: int, pass_: Pass) -> list[Op]:
    """Autocast casts each linear's fp32 input (a norm's output) to the training dtype,
    one copy per linear; the backward casts each input gradient back to fp32
    (``ToCopyBackward0``). The forward's weight casts are cached for the autocast
    region, one per step, and left out."""
    if not x.st.amp(x.dt) or pass_ == "bwd_weight":
        return []
    return [mem(name, linears * x.tokens * x.spec.hidden, x.rs + x.dt, "copy", linears)]


def _weight_ops(x: _Shape) -> list[Op]:
    """Bias and norm-parameter gradients, and AccumulateGrad for 16-bit grads."""
    T, L, h = x.tokens, x.local, x.spec.hidden
    weights = sum(_weight_elements(x, n) for n in ("qkv", "out_proj", "mlp_up", "mlp_down"))
    linears = qkv_linears(x.st) + 1 + up_linears(x.spec, x.st) + 1
    biased = x.spec.bias
    return _grad_ops(x, T * (x.q + 2 * x.kv) + T * x.up + 2 * L * h,
                     x.qkv_kernels + x.up_kernels + 2, weights,
                     weights + (x.q + 2 * x.kv + h + x.up + h if biased else 0.0),
                     linears * (2 if biased else 1), layer_tensors(x.spec, x.st))


def _grad_ops(x: _Shape, bias_elements: float, bias_kernels: int, weights: float,
              cast_elements: float, cast_kernels: int, tensors: int) -> list[Op]:
    """A layer's own parameter-gradient ops besides the wgrad GEMMs: ``bias_grad`` (dbias
    = Σ_tokens dY over ``bias_elements``, one reduction per biased linear), ``norm_grad``
    (γ and β partial sums, then the sum), under autocast ``amp_weight_cast`` (each
    16-bit gradient cast to its fp32 parameter's), and ``grad_accum`` (AccumulateGrad's
    add over ``weights`` in ``tensors`` kernels) or, with fp32 main grads, ``main_grad``."""
    L, h, dt = x.local, x.spec.hidden, x.dt
    bias, accum = _param_grad_ops(x.spec, x.st, dt, "", bias_elements, bias_kernels, weights,
                                  weights, cast_elements, cast_kernels, tensors)
    return [*bias, mem("norm_grad", 2 * 2 * L * h, dt, "reduction", 2 * norm_tensors(x.spec)),
            *accum]


def _param_grad_ops(spec: ModelSpec, stack: StackSpec, dt: int, prefix: str,
                    bias_elements: float, bias_kernels: int, weights: float,
                    accum_elements: float, cast_elements: float, cast_kernels: int,
                    tensors: int) -> tuple[list[Op], list[Op]]:
    """The parameter-gradient ops of :func:`_grad_ops` and :func:`expert_weight_ops`
    (named with ``prefix``): the bias gradients; then under autocast the casts, and
    AccumulateGrad's add over ``accum_elements`` or the fp32 main grads' traffic."""
    bias = [mem(f"{prefix}bias_grad", bias_elements, dt, "reduction", bias_kernels)] \
        if spec.bias else []
    accum: list[Op] = []
    if stack.amp(dt):
        accum.append(mem(f"{prefix}amp_weight_cast", cast_elements, dt + 4, "copy",
                         cast_kernels))
    if stack.main_grads == "param":  # AccumulateGrad adds each micro-batch's grads
        accum.append(mem(f"{prefix}grad_accum", 3 * accum_elements,
                         4 if stack.amp(dt) else dt, "elementwise", tensors))
    else:  # the wgrad GEMMs read-modify-write the fp32 main_grad in their epilogue
        # (gradient_accumulation_fusion): 8 bytes per weight instead of the 16-bit write
        accum.append(Op(f"{prefix}main_grad", "memory", 0.0, (8 - dt) * weights, 0.0,
                        "elementwise", 0))
    return bias, accum


#: ops on DTensor operands when TP runs as DTensor (torch.distributed.tensor.parallel):
#: the Colwise/Rowwise linears (their GEMMs, bias and weight grads); under sequence
#: parallelism also the norms (``SequenceParallel`` replicates their parameters) and the
#: residual stream, which stays a sequence-sharded DTensor between layers
DTENSOR_OPS = ("qkv", "out_proj", "mlp_up", "mlp_down", "bias_grad", "grad_accum")
DTENSOR_SP_OPS = ("ln1", "ln2", "residual", "grad_sum", "norm_grad")


def _dtensor(x: _Shape, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """Mark the ops DTensor dispatches (each pays its sharding propagation on the host)."""
    if not x.st.dtensor or x.tp == 1:
        return ops
    names = DTENSOR_OPS + (DTENSOR_SP_OPS if x.sp else ())
    return tuple(replace(op, dtensor=op.kernels) if op.name in names else op for op in ops)


def dtensor_tensors(spec: ModelSpec, stack: StackSpec, tp: int, sp: bool) -> int:
    """Parameter tensors of one dense layer that are DTensors under TP (their optimizer
    ops dispatch through DTensor): the linears' weights and biases, and with sequence
    parallelism the norms' too."""
    if not stack.dtensor or tp == 1:
        return 0
    return layer_tensors(spec, stack) - (0 if sp else 2 * norm_tensors(spec))


def tp_block_collectives(spec: ModelSpec, stack: StackSpec, tp: int, sp: bool, label: str,
                         backward: bool) -> int:
    """TP collectives after one block (``attn`` or ``mlp``) in one pass, besides the
    all-gather before it under sequence parallelism.

    Megatron-LM: one (Shoeybi et al. 2019, §3: the row-parallel output's all-reduce in
    forward, the column-parallel input gradient's in backward). TP as DTensor without
    sequence parallelism, in backward: every ``ColwiseParallel`` module wraps its plain
    input in a replicated DTensor of its own (torch/distributed/tensor/parallel/style.py,
    ``ColwiseParallel._prepare_input_fn``: ``DTensor.from_local(input, mesh,
    Replicate())``), so each one's partial input gradient is all-reduced on its own: q,
    k and v (one with fused projections), and gate and up of a gated MLP. Under
    sequence parallelism one ``PrepareModuleInput`` gathers the block's input, which
    its projections share, so one reduce-scatter serves them all."""
    if tp == 1:
        return 0
    if not (stack.dtensor and backward and not sp):
        return 1
    return qkv_linears(stack) if label == "attn" else up_linears(spec, stack)


#: What a TP collective at the model's ends carries: the b·s·h activation (or its
#: gradient), the b·s·V logits, or the cross-entropy's fp32 value per token.
EndPayload = Literal["activation", "logits", "loss"]


def tp_end_collectives(stack: StackSpec, tp: int, sp: bool,
                       where: Literal["embed", "head", "loss"], forward: bool,
                       ) -> tuple[tuple[CollectiveName, EndPayload], ...]:
    """The TP collectives of one micro-batch at the model's ends, in order.

    Megatron's vocab-parallel ends: the embedding's partial sums all-reduced after its
    forward (reduce-scattered under sequence parallelism), its incoming gradient
    all-gathered under SP; the output layer's replicated input all-gathered under SP and
    its input gradient all-reduced (reduce-scattered); the vocab-parallel cross-entropy's
    three fp32 all-reduces per token (max, target logit, sum of exponentials). As DTensor
    (``stack.dtensor``): the embedding's output all-reduced to a replicated tensor even
    under SP (then cut locally), and the logits all-gathered whole (``ColwiseParallel``
    with a replicated output) for a cross-entropy with no collective of its own."""
    if tp == 1:
        return ()
    if where == "loss":
        if not forward:
            return ()
        return (("all_gather", "logits"),) if stack.dtensor else (("all_reduce", "loss"),) * 3
    if where == "embed":
        if forward:
            return (("reduce_scatter" if sp and not stack.dtensor else "all_reduce",
                     "activation"),)
        return (("all_gather", "activation"),) if sp else ()
    if forward:
        return (("all_gather", "activation"),) if sp else ()
    return (("reduce_scatter" if sp else "all_reduce", "activation"),)


def tp_optimizer_collectives(spec: ModelSpec, stack: StackSpec, tp: int, sp: bool,
                             layers: int, last: bool) -> int:
    """All-reduces the optimizer step issues over the TP group on a rank holding
    ``layers`` layers (two norms each) and, on the ``last`` stage, the final norm: under
    DTensor with sequence parallelism the norms'
    replicated parameters keep partial gradients until the for-loop AdamW reads them,
    and each op with the gradient as an operand all-reduces it (torch/optim/adam.py
    ``_single_tensor_adam``: ``exp_avg.lerp_(grad)`` and
    ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad)``), three per norm tensor, each of
    ``hidden`` elements."""
    if tp == 1 or not (stack.dtensor and sp) or stack.optimizer != "per_tensor":
        return 0
    return 3 * (2 * layers + (1 if last else 0)) * norm_tensors(spec)


def dense_layer_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                    dtype: str, pass_: Pass, stack: StackSpec) -> tuple[Op, ...]:
    """One dense layer's ops on one TP rank, in execution order."""
    x = _Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return _dtensor(x, _dense_layer_ops(x, pass_))


def _dense_layer_ops(x: _Shape, pass_: Pass) -> tuple[Op, ...]:
    g = _gemms(x, pass_)
    if pass_ == "bwd_weight":
        return (*g.values(), *_weight_ops(x))
    return _frame(x, pass_, g, [*_amp_cast(x, "amp_cast_up", x.up_kernels, pass_),
                                g["mlp_up"], _act(x, pass_), g["mlp_down"]], x.up_kernels)


def _frame(x: _Shape, pass_: Pass, g: dict[str, Op], mlp: list[Op],
           readers: int) -> tuple[Op, ...]:
    """A layer in execution order around its MLP block ``mlp`` (forward order), whose
    ``readers`` projections read the normed input: the norms, the attention as the stack
    runs it, the residuals and, backward, the gradient sums where the stream forks."""
    grad_sum = [mem("grad_sum", 3 * x.local * x.spec.hidden, x.rs, "elementwise")] \
        if pass_ == "bwd_input" else []
    ops = (*grad_sum, _norm(x, "ln1", pass_),
           *_fork_grad_sum(x, "qkv_grad_sum", x.qkv_kernels, pass_),
           *_amp_cast(x, "amp_cast_qkv", x.qkv_kernels, pass_), g["qkv"], *_rope(x, pass_),
           *_attention(x, pass_), g["out_proj"], *_residual(x, pass_), *grad_sum,
           _norm(x, "ln2", pass_), *_fork_grad_sum(x, "up_grad_sum", readers, pass_), *mlp,
           *_residual(x, pass_))
    return ops if pass_ == "fwd" else ops[::-1]


def _fork_grad_sum(x: _Shape, name: str, gemms: int, pass_: Pass) -> list[Op]:
    """Separate projections reading the same normed input (q, k and v; SwiGLU's gate and
    up): autograd adds their input gradients (one add over T·h per extra GEMM) before
    the norm's backward."""
    if pass_ != "bwd_input" or gemms == 1:
        return []
    adds = gemms - 1  # under autocast the gradients were cast back to fp32 first
    return [mem(name, 3 * adds * x.tokens * x.spec.hidden, x.rs, "elementwise", adds)]


# ---------------------------------------------------------------- a mixture of experts


def routed_tokens(spec: ModelSpec, tokens: float, padded: bool) -> float:
    """Token-expert pairs the routed experts compute: k per token dropless; c·k with a
    capacity factor c (every expert's buffer computed whether full or not; model FLOPs,
    ``padded=False``, count min(c, 1)·k, what the model computes for the tokens it
    keeps)."""
    c = spec.capacity_factor
    if c is None:
        return tokens * spec.experts_per_token
    return tokens * spec.experts_per_token * (c if padded else min(c, 1.0))


def _grouped(name: str, m: float, k: float, n: float, groups: int, dt: int, cls: str,
             saved: float = 0.0, calls: int = 1) -> Op:
    """``groups`` GEMMs of (m/groups × k)·(k × n), one weight each, in ``calls`` launches
    (:func:`expert_calls`; the efficiency-curve lookup at one expert's product)."""
    flops = 2.0 * m * k * n
    return Op(name, "gemm", flops, dt * (m * k + groups * k * n + m * n), flops / groups, cls,
              calls, saved)


def expert_calls(stack: StackSpec | None, groups: int) -> int:
    """Launches of one projection (or activation) of ``groups`` local routed experts: one
    per expert under ``stack.moe_experts: modules``, whose experts are modules called in
    turn (Megatron-core's SequentialMLP, megatron/core/transformer/moe/experts.py, and
    TEGroupedMLP's GroupedLinear, one GEMM per ``weight{i}``; DeepSpeed's
    deepspeed/moe/experts.py Experts; our calibration/measured/moe_worker.py), one
    grouped call under ``grouped`` (torchtitan/models/moe.py GroupedExperts:
    ``torch._grouped_mm``). Without a stack, one call."""
    return groups if stack is not None and stack.moe_experts == "modules" else 1


def _expert_act(spec: ModelSpec, tokens: float, width: float, dt: int, pass_: Pass,
                name: str, kernels: int = 1) -> Op:
    """An expert MLP's activation over ``tokens`` × ``width``: it reads and writes
    (GeLU) 2, (SwiGLU) 3 elements a unit forward, 3 and 5 backward; keeps its input."""
    swiglu = spec.activation == "swiglu"
    factor = (3.0 if swiglu else 2.0) if pass_ == "fwd" else (5.0 if swiglu else 3.0)
    keep = (2 if swiglu else 1) * tokens * width * dt if pass_ == "fwd" else 0.0
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
    keep = pass_ == "fwd"
    calls = expert_calls(stack, groups)
    ops = [_grouped("expert_up", tokens, h, up, groups, dt, cls, dt * tokens * h * keep,
                    calls),
           _expert_act(spec, tokens, width, dt, pass_, "expert_act", calls),
           _grouped("expert_down", tokens, width, h, groups, dt, cls,
                    dt * tokens * width * keep, calls)]
    buffers = eager_buffer_op(tokens, h, groups, ep, dt, pass_) \
        if stack is not None and stack.moe_routing == "eager" else None
    return ops if buffers is None else [*ops, buffers]


def expert_weight_ops(spec: ModelSpec, stack: StackSpec, tokens: float, width: float,
                      groups: int, dt: int) -> list[Op]:
    """The routed experts' parameter-gradient ops besides their wgrad GEMMs, on one rank's
    ``groups`` local experts over ``tokens`` token-expert pairs, as :func:`_grad_ops`
    has them for a layer's own tensors (:func:`_param_grad_ops`): ``bias_grad`` (one
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
    bias, accum = _param_grad_ops(spec, stack, dt, "expert_", tokens * (up + h),
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


def _moe_mlp(x: _Shape, pass_: Pass, padded: bool) -> list[Op]:
    """A MoE layer's MLP block in forward order: the router (replicated over TP; keeps
    its input, the normed tokens every branch reads, and its fp32 probabilities), the
    permutation into the experts' buffers, the shared experts as one MLP of width
    shared · f_e (Megatron-LM's fused shared experts), the routed experts, and the
    weighted un-permutation (copies of k·T·h elements)."""
    spec, T, L, h, dt = x.spec, x.tokens, x.local, x.spec.hidden, x.dt
    cls = {"fwd": "gemm_fwd", "bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}[pass_]
    keep = pass_ == "fwd"
    routed = routed_tokens(spec, T, padded)
    f = spec.expert_ffn / x.tp
    eager = x.st.moe_routing == "eager"
    into, back = EAGER_ROUTING.get(pass_, (1, 1)) if eager else (1, 1)
    rows_in, rows_back = eager_routing_rows(pass_, T, routed, routed_tokens(spec, T, False)) \
        if eager else (T + routed, routed + T)
    ops = [gemm("router", L, h, spec.experts, dt, cls, 1,
                (dt * L * h + 4 * L * spec.experts) * keep),
           mem("permute", rows_in * h, dt, "elementwise", into)]
    if spec.shared_experts:
        width = spec.shared_experts * f
        up = (2 if spec.activation == "swiglu" else 1) * width
        ops += [gemm("shared_up", T, h, up, dt, cls),
                _expert_act(spec, T, width, dt, pass_, "shared_act"),
                gemm("shared_down", T, width, h, dt, cls, 1, dt * T * width * keep)]
    return [*ops, *routed_expert_ops(spec, routed, f, spec.experts, dt, pass_, x.st),
            mem("unpermute", rows_back * h, dt, "elementwise", back)]


def moe_mlp_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                dtype: str, pass_: Pass, stack: StackSpec, padded: bool = True) -> list[Op]:
    """A MoE layer's MLP block on one TP rank, forward order (:func:`_moe_mlp`): what a
    latent-attention model's MoE layers (:func:`simulator.model.moe.layer_ops`) run too."""
    x = _Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return _moe_mlp(x, pass_, padded)


def moe_layer_ops(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                  dtype: str, pass_: Pass, stack: StackSpec, padded: bool = True,
                  ) -> tuple[Op, ...]:
    """A routed-experts layer (standard attention) on one TP rank, in execution order:
    the dense layer's frame as the stack runs it (norms, projections, attention,
    residuals, their gradient sums, casts and DTensor dispatch) with the MLP replaced by
    :func:`_moe_mlp`. The routed experts' ops are here for the layer's FLOPs and what
    it keeps; the workload takes them out and the expert pass prices them on the ranks
    that hold the experts (:func:`simulator.strategies.expert_parallel.expert_layer`)."""
    x = _Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return _dtensor(x, _moe_layer_ops(x, pass_, padded))


def _moe_layer_ops(x: _Shape, pass_: Pass, padded: bool) -> tuple[Op, ...]:
    g = _gemms(x, pass_)
    mlp = _moe_mlp(x, pass_, padded)
    if pass_ == "bwd_weight":  # the routed experts' own weight-gradient ops last
        experts = expert_weight_ops(x.spec, x.st, routed_tokens(x.spec, x.tokens, padded),
                                    x.spec.expert_ffn / x.tp, x.spec.experts, x.dt)
        return (g["qkv"], g["out_proj"], *(op for op in mlp if op.kind == "gemm"),
                *_moe_weight_ops(x), *experts)
    readers = 2 + (1 if x.spec.shared_experts else 0)  # router, permutation, shared experts
    return _frame(x, pass_, g, [*_amp_cast(x, "amp_cast_up", 1, pass_), *mlp], readers)


def _moe_weight_ops(x: _Shape) -> list[Op]:
    """As :func:`_weight_ops` for the layer's own parameters: the attention's, the
    norms', the router's and the shared experts'. The routed experts' gradients are the
    expert pass's (their ranks hold them)."""
    spec, T, L, h = x.spec, x.tokens, x.local, x.spec.hidden
    f = spec.shared_experts * spec.expert_ffn / x.tp
    up = (2 if spec.activation == "swiglu" else 1) * f
    shared = 1 if spec.shared_experts else 0
    weights = _weight_elements(x, "qkv") + _weight_elements(x, "out_proj") \
        + h * spec.experts + shared * (h * up + f * h)
    tensors = moe_layer_tensors(spec, x.st)
    return _grad_ops(x, T * (x.q + 2 * x.kv) + L * h + shared * (T * up + L * h),
                     x.qkv_kernels + 1 + 2 * shared, weights, weights, tensors, tensors)


def layer_tensors(spec: ModelSpec, stack: StackSpec, layer: int | None = None) -> int:
    """Parameter tensors of one layer as the stack builds it, its routed experts apart
    (:func:`expert_tensors`): a dense layer's linears (weights and biases) and norms, or
    where ``layer`` is one of a mixture of experts' MoE layers :func:`moe_layer_tensors`
    (the optimizer's per-tensor kernels, DDP's bucket copies)."""
    if layer is not None and spec.is_moe_layer(layer):
        return moe_layer_tensors(spec, stack)
    linears = qkv_linears(stack) + 1 + up_linears(spec, stack) + 1
    return linears * (2 if spec.bias else 1) + 2 * norm_tensors(spec)


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


def zero3_collectives(spec: ModelSpec, stack: StackSpec) -> int:
    """All-gathers (and reduce-scatters) one dense layer's parameters take under ZeRO-3:
    one per layer, or one per linear module (QKV, or q, k, v; out-proj; MLP up, or
    gate and up; down), as :func:`zero3_blocks` lists them. A mixture of experts gathers
    whole layers (the expert pass regroups the experts)."""
    return sum(len(parts) for parts in zero3_blocks(spec, stack, 1, 1.0).values())


def zero3_blocks(spec: ModelSpec, stack: StackSpec, tp: int,
                 layer_elements: float) -> dict[str, tuple[float, ...]]:
    """The elements of each of one dense layer's ZeRO-3 all-gathers on one TP rank
    (:func:`zero3_collectives` of them), by the block that needs them first: the whole
    layer under ``attn`` for a layer unit (FSDP), else each linear module's weight
    under its block (DeepSpeed: q, k, v or QKV and out-proj under ``attn``; gate and up
    or up, and down under ``mlp``). ``layer_elements`` (the layer's parameters on the
    rank) is shared out in proportion to the weights, so the norms and biases that
    DeepSpeed keeps whole (``stage3_param_persistence_threshold``, 1e5 elements) ride
    with them; they are under 0.1% of a layer at these sizes."""
    if stack.zero3_unit == "layer" or spec.is_moe:
        return {"attn": (layer_elements,)}
    x = _Shape(spec, 1, tp, False, 2, stack)
    qkv = [x.spec.hidden * x.q] + [x.spec.hidden * x.kv] * 2 if qkv_linears(stack) == 3 \
        else [_weight_elements(x, "qkv")]
    ups = up_linears(spec, stack)
    up = [_weight_elements(x, "mlp_up") / ups] * ups
    weights = {"attn": (*qkv, _weight_elements(x, "out_proj")),
               "mlp": (*up, _weight_elements(x, "mlp_down"))}
    scale = layer_elements / sum(sum(w) for w in weights.values())
    return {block: tuple(w * scale for w in ws) for block, ws in weights.items()}


#: parameter tensors of a stage's root unit (FSDP2's ``fully_shard`` on the stage's
#: module): the embedding tables and the final norm's
ROOT_TENSORS = 4
#: parameter tensors an end of the model adds to a gradient entry: the embedding's two
#: tables, or the final norm's weight and bias riding with the first layer reduced
END_TENSORS = 2


def fsdp_gather_ops(stack: StackSpec, elements: float, dp: int, dt: int,
                    tensors: int) -> tuple[Op, ...]:
    """FSDP2's copies around one unit's all-gather of ``elements`` parameters of ``dt``
    bytes over ``dp`` ranks, under a stack with ``fsdp_copies``
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Before it, on the
    all-gather's stream: under a MixedPrecisionPolicy (the stack keeps fp32 main grads
    beside fp32 sharded parameters, and trains in a 16-bit ``dt``)
    ``_get_param_all_gather_inputs`` casts the shard into a flat buffer
    (``torch._foreach_copy_``); ``all_gather_copy_in`` copies it into the rank's slot of
    the all-gather output (``_foreach_copy_``). After it, on the compute stream,
    ``foreach_all_gather_copy_out`` splits the gathered buffer into the unsharded
    parameters (``split_with_sizes_copy``: every element read and written once).
    Each is one kernel over the unit's ``tensors`` parameter tensors, whose host work is
    per tensor (the lists of views FSDP2 builds; on a CPU ``_foreach_copy_`` and
    ``split_with_sizes_copy`` loop over them). The ops before the gather, then the
    copy-out (the last); none without the copies."""
    if not stack.fsdp_copies or elements <= 0:
        return ()
    shard = elements / dp
    before = [_per_tensor(mem("fsdp_cast_in", shard, 4 + dt, "copy"), tensors)] \
        if stack.main_grads == "fp32" and dt < 4 else []
    return (*before, _per_tensor(mem("fsdp_copy_in", shard, 2 * dt, "copy"), tensors),
            _per_tensor(mem("fsdp_copy_out", elements, 2 * dt, "copy"), tensors))


def _per_tensor(op: Op, tensors: int) -> Op:
    """``op`` with host work per tensor (one kernel over a list of ``tensors``)."""
    return replace(op, host_units=max(tensors, 1))


def fsdp_reduce_ops(stack: StackSpec, elements: float, dp: int, grad_dt: int, reduce_dt: int,
                    tensors: int, accumulate: bool) -> tuple[Op, ...]:
    """FSDP2's copies around one unit's reduce-scatter of ``elements`` gradients
    (``foreach_reduce``, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), under a
    stack with ``fsdp_copies``: before it, on the compute stream, ``chunk_cat`` packs the
    unsharded gradients (``grad_dt`` bytes) into the reduce-scatter input (``reduce_dt``:
    the cast to the reduce dtype happens in it); after it, on a micro-batch after the
    first (``accumulate``), each of the unit's ``tensors`` sharded ``.grad`` adds its
    reduced shard (``grad._local_tensor += new_sharded_grad``, one add per tensor; the
    first micro-batch's shard becomes ``.grad`` as it is). The pack, then the add where
    there is one; none without the copies."""
    if not stack.fsdp_copies or elements <= 0:
        return ()
    ops = [_per_tensor(mem("fsdp_chunk_cat", elements, grad_dt + reduce_dt, "copy"), tensors)]
    if accumulate:
        ops.append(mem("fsdp_grad_accum", elements / dp, 3 * reduce_dt, "elementwise", tensors))
    return tuple(ops)


def ddp_copy_ops(stack: StackSpec, elements: float, dt: int, tensors: int,
                 back: bool) -> tuple[Op, ...]:
    """torch DDP's copies of ``elements`` gradients of ``dt`` bytes in ``tensors`` tensors,
    under a stack with ``ddp_copies`` (torch/csrc/distributed/c10d/reducer.cpp, with
    ``gradient_as_bucket_view=False``): into a bucket, each gradient scaled by 1/N on the
    way as it becomes ready (``mark_variable_ready_dense``: ``at::mul_out``, one kernel per
    tensor; a plain ``copy_`` under a communication hook), or (``back``) the reduced
    buckets back into the gradients once the backward's reductions are done
    (``finalize_bucket_dense``: ``copy_bucket_to_grad``, one per tensor). Each reads
    and writes every element once."""
    if not stack.ddp_copies or elements <= 0:
        return ()
    return (mem("ddp_bucket_out" if back else "ddp_bucket_in", elements, 2 * dt,
                "copy" if back else "elementwise", max(tensors, 1)),)


def kept_for_backward(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                      dtype: str, recompute: str, stack: StackSpec, layer: int = 0) -> float:
    """Bytes one layer (dense, or a mixture of experts' ``layer``) keeps between its
    forward and backward: what its forward ops save; under selective recomputation the
    core's internals (scores, softmax, dropout, statistics) are dropped and only its
    inputs Q, K, V kept; under full recomputation only the layer's input (sharded under
    sequence parallelism; fp32 under autocast)."""
    x = _Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    if recompute == "full":
        return x.rs * x.local * spec.hidden
    ops = moe_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, "fwd", stack) \
        if spec.is_moe_layer(layer) else \
        dense_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, "fwd", stack)
    if recompute == "selective":
        core_inputs = x.dt * x.tokens * (x.q + 2 * x.kv)
        return sum(op.saved for op in ops if op.name not in CORE_OPS) + core_inputs
    return sum(op.saved for op in ops)


def optimizer_op(params: float, tensors: int, stack: StackSpec, dtype: str,
                 dtensors: int = 0) -> Op:
    """AdamW on ``params`` parameters in ``tensors`` tensors (one rank's shard).

    Per parameter: read the gradient (main-grad dtype), read and write the fp32 master
    weight, momentum and variance, write the 16-bit copy (fp32 training: the weights are
    the master); global-norm clipping reads the gradients once more and scales them in
    place. Kernels: fused multi-tensor apply launches one kernel per ~110 tensors or
    2.1e7 elements (apex ``multi_tensor_apply``: 110 tensors, 320 blocks × 65,536);
    ``foreach`` runs its ~7 foreach ops over the same chunks; ``per_tensor`` (the for-loop
    AdamW, torch/optim/adamw.py ``_single_tensor_adamw``) runs 10 ops per tensor: the
    step count's add, the weight decay's mul, lerp, mul and addcmul on the moments, the
    step's ``item``, sqrt, div and add for the denominator, the update's addcdiv.

    Host work: a kernel's for the fused and per-tensor forms; foreach does its host work
    per tensor of each foreach op (``_multi_tensor_adamw`` builds per-tensor lists, its
    step counters and bias corrections in Python; each ``_foreach_*`` op checks and
    groups every tensor), so its host units are 7 per tensor, not 7 per chunk."""
    dt = dtype_bytes(dtype)
    amp = stack.amp(dt)  # autocast: the parameters and their gradients are fp32
    g = 4 if amp else stack.main_grad_bytes(dt)
    # fp32 parameters: w, m, v read + write; else the fp32 master too, and the 16-bit copy
    per_param = g + 24.0 if dt == 4 or amp else g + 24.0 + dt
    clip = 3 * g if stack.grad_clip else 0
    chunks = max(1, math.ceil(tensors / 110), math.ceil(params / 2.1e7))
    kernels = {"fused": chunks, "foreach": 7 * chunks, "per_tensor": 10 * tensors}[stack.optimizer]
    if stack.grad_clip:
        kernels += 2 * chunks
    op = mem("optimizer", params * (per_param + clip), 1, "optimizer", int(kernels))
    if stack.optimizer == "foreach":
        op = replace(op, host_units=7 * tensors + (2 * chunks if stack.grad_clip else 0))
    if stack.optimizer == "per_tensor" and dtensors:  # each op on a DTensor dispatches as one
        op = replace(op, dtensor=10 * dtensors)
    return op

"""The inventory's vocabulary: an :class:`Op` (FLOPs, HBM bytes, cost class, kernels,
bytes kept for backward, a GEMM's call shape, :func:`call_shape`), the passes, element
sizes, and :class:`Shape`, one layer on one TP rank for one micro-batch, that every op
builder reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec
from simulator.system.attention_kernels import AttentionCall
from simulator.system.gemm_shape import GemmCall

OpKind = Literal["gemm", "attention", "memory"]


Pass = Literal["fwd", "bwd_input", "bwd_weight"]


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


#: the ops inside the attention core (what selective recomputation re-runs)
CORE_OPS = ("attn_core", "attn_scores", "attn_softmax", "attn_dropout", "attn_av")


#: A fused attention backward's launches: the dO·O row sums, the main kernel and the
#: conversion of dQ, accumulated in fp32 (FlashAttention-2's csrc/flash_attn/src/
#: flash_bwd_launch_template.h: flash_bwd_dot_do_o_kernel, the main kernel, kernel_dq;
#: FlashAttention-3's hopper/flash_bwd_launch_template.h: FlashAttnBwdPreprocess, the
#: main kernel, FlashAttnBwdPostprocessConvertdQ; cuDNN's SDPA backward chain: dot
#: preprocess, the fused main kernel, the dQ convert; FlashAttention 1.0.x's
#: csrc/flash_attn/fmha_api.cpp mha_bwd: the fp32 dq_tmp zeroed, the main kernel,
#: dq.copy_(dq_tmp)). flash_attn_triton.py's _flash_attn_backward (llm-foundry's copy,
#: b2a43a1) launches four: _bwd_preprocess_do_o_dot, the fp32 dq_accum's zero_() (the
#: autotune configs' pre_hook init_to_zero('DQ'), which Triton's Autotuner.run calls
#: before every launch), _bwd_kernel, dq.copy_(dq_accum). Their bytes lie inside the
#: curves: each kernel's is a benchmark of the whole backward call.
FLASH_BWD_KERNELS = {"flash2": 3, "flash3": 3, "cudnn": 3, "te": 3, "flash1": 3,
                     "flash_triton": 4}


#: Executed / counted FLOPs of a causal flash-attention kernel: it skips the blocks above
#: the diagonal (FlashAttention-2, Dao 2023, §3.1.1). Efficiencies of such kernels are
#: quoted against the executed FLOPs (flash-attn's benchmarks/benchmark_flash_attention.py
#: halves its FLOP count when causal), and calibration fits them the same way
#: (calibration/microbench/fit_terms.py ``executed_peak``).
CAUSAL_FLASH_SCALE = 0.5


#: Executed / counted FLOPs of a fused attention backward: it keeps no probabilities, so
#: it recomputes S = QKᵀ before dV = PᵀdO, dP = dO·Vᵀ, dQ = dS·K and dK = dSᵀ·Q, five
#: GEMMs of the forward's two, 2.5 times the forward where the model counts 2
#: (FlashAttention-2, Dao 2023, Algorithm 2; flash-attn's benchmark_flash_attention.py
#: counts the backward as 2.5 × the forward; cuDNN's "fused five-GEMM" backward)
FLASH_BWD_RECOMPUTE = 1.25


def flash_scale(pass_: str) -> float:
    """Executed / counted FLOPs of a causal fused attention call in ``pass_`` (``fwd`` or
    a backward): the causal half, times the backward's recomputation."""
    return CAUSAL_FLASH_SCALE * (1.0 if pass_ == "fwd" else FLASH_BWD_RECOMPUTE)


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
    #: a fused attention call: priced on its kernel's curves by sequence and head dimension
    #: where the profile has them (simulator/system/attention_kernels.py)
    attn: AttentionCall | None = None
    #: the element type a GEMM runs in where it is not the training dtype's: ``fp8`` for the
    #: linears of a stack with ``stack.fp8`` (priced at the GPU's fp8 peak)
    precision: str = ""
    #: a GEMM's shape, one call as the pass runs it (:func:`call_shape`), whose tile and wave
    #: quantisation the profile may price (simulator/system/gemm_shape.py); None: by FLOPs
    gemm_call: GemmCall | None = None
    #: FP32 operations the kernel executes on the CUDA cores (not the tensor cores), its
    #: arithmetic floor where that bounds it before HBM does (a transcendental per element:
    #: :data:`TORCH_GELU_FP32_FLOPS`), priced against the GPU's fp32 peak
    alu_flops: float = 0.0
    #: the host reads a device value back before issuing each group of these kernels (a
    #: ``.item()`` on a CUDA tensor), so it waits for the device each time and its issue
    #: work and the device's run one after the other: the op's time is their sum, not the
    #: larger (Composer's DecoupledAdamW reads each parameter's step count so)
    synced: bool = False

    @property
    def host_ops(self) -> int:
        """Units of host work (``host_units``, else one per kernel)."""
        return self.kernels if self.host_units is None else self.host_units

    @property
    def cost_class(self) -> str:
        if self.cls:
            return self.cls
        return {"gemm": "gemm_fwd", "attention": "attention_fwd"}.get(self.kind, "elementwise")


#: PyTorch's own exact GeLU (``F.gelu``, ``approximate='none'``; aten/src/ATen/native/cuda/
#: ActivationGeluKernel.cu: x · ½ · (1 + erf(x/√2)) in fp32 per element) costs its arithmetic,
#: not only its bytes: measured by ``clustersim calibrate`` on an H200 (docs/validation/
#: profile-nvidia-h200-2026-12-04.results.jsonl, ``cuda/bf16/t1/memory/gelu/61035x4096``),
#: 250.0 M bf16 elements took 312.8 µs where a copy of the same bytes took 235.3 µs (1.30-1.33
#: times the copy at every size timed, and as much in the session before), so the kernel is
#: bound by its CUDA cores: 312.8 µs at the H200's 67 TFLOP/s fp32 (datasheet) is 83.8 fp32
#: operations an element. Its backward (GeluBackwardCUDAKernelImpl) evaluates the same erf
#: and an exp besides; it is priced at the forward's count, a lower bound. Another GPU runs
#: them at its own fp32 peak (its CUDA cores × clock), so an A100 (19.5 TFLOP/s against 2.0
#: TB/s) is bound by them where an H100 is not. Fused GeLUs (Megatron's bias_gelu, Transformer
#: Engine's, compiled ones) are other kernels and are not priced so.
TORCH_GELU_FP32_FLOPS = 83.8


def dtype_bytes(dtype: str) -> int:
    """Bytes per element: bf16/fp16 2, fp32 4."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}") from None


#: The output (rows, columns) and reduction of a linear Y[m×n] = X[m×k]·W[k×n]'s GEMM in
#: each pass: forward Y (m×n over k), input gradient dX = dY·Wᵀ (m×k over n), weight
#: gradient dW = Xᵀ·dY (k×n over m); keyed by cost class and by pass.
PASS_SHAPES: dict[str, tuple[str, str, str]] = {
    "gemm_fwd": ("m", "n", "k"), "gemm_dgrad": ("m", "k", "n"), "gemm_wgrad": ("k", "n", "m"),
    "fwd": ("m", "n", "k"), "bwd_input": ("m", "k", "n"), "bwd_weight": ("k", "n", "m")}


def call_shape(m: float, k: float, n: float, pass_: str, calls: int = 1,
               groups: int = 1) -> GemmCall:
    """One call of an (m×k)·(k×n) linear as ``pass_`` (a pass or a GEMM cost class; any
    other: the forward) runs it: its ``calls`` launches split n (separate q, k, v or gate
    and up) or, with ``groups`` experts, the experts (m/groups rows each; a launch of
    several runs them as one batch)."""
    dims = {"m": m / groups, "k": k, "n": n / (1 if groups > 1 else calls)}
    rows, cols, depth = PASS_SHAPES.get(pass_, ("m", "n", "k"))
    return GemmCall(dims[rows], dims[cols], dims[depth], max(groups // calls, 1))


def gemm(name: str, m: float, k: float, n: float, dt: int, cls: str = "", kernels: int = 1,
         saved: float = 0.0) -> Op:
    """An (m×k)·(k×n) product in ``kernels`` equal calls; its dgrad and wgrad read and
    write the same three shapes."""
    flops = 2.0 * m * k * n
    return Op(name, "gemm", flops, dt * (m * k + k * n + m * n), flops / kernels, cls, kernels,
              saved, gemm_call=call_shape(m, k, n, cls, kernels))


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
class Shape:
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
    def kept_in(self) -> float:
        """Tokens of the block input the first projections (QKV, MLP up, a MoE router)
        keep: the rank's shard under sequence parallelism, re-gathered in backward
        (Megatron), or the gathered whole DTensor's matmul saves
        (``stack.sp_input_backward: saved``)."""
        return self.tokens if self.sp and self.st.sp_input_backward == "saved" else self.local

    @property
    def q(self) -> float:
        return self.spec.q_width / self.tp

    @property
    def kv(self) -> float:
        return kv_per_rank(self.spec, self.tp) * self.spec.head_size

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


def dense_layer_tensors(spec: ModelSpec, stack: StackSpec) -> int:
    """Parameter tensors of one dense layer as the stack builds it: its linears (weights
    and biases) and norms."""
    linears = qkv_linears(stack) + 1 + up_linears(spec, stack) + 1
    return linears * (2 if spec.bias else 1) + 2 * norm_tensors(spec)

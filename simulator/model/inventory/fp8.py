"""FP8 linears as Transformer Engine runs them (``stack.fp8``): the GEMMs, the casts around
them, the scale bookkeeping and the FP8 weight copies a rank holds.

What changes for one linear Y = X·W of a stack with FP8 (transformer_engine/pytorch/module/
linear.py ``_Linear``; the recipes in transformer_engine/common/recipe/__init__.py):

- **The GEMMs** (forward, dgrad, wgrad) read FP8 operands (1 byte) and write a 16-bit
  result (the wgrad's into the fp32 main grad as before), priced at the GPU's fp8 peak
  (:mod:`simulator.system.costs`). E4M3 forward, E5M2 for the gradients (the hybrid
  format, TE's and Megatron's ``--fp8-format hybrid``): both are one byte.
- **The input's cast** (``fp8_x_<linear>``), once per micro-batch: the 16-bit input read,
  FP8 written row-wise (the forward GEMM's operand) and column-wise (the wgrad's, which the
  Hopper FP8 GEMM needs transposed: the quantizer's ``columnwise`` usage), one fused
  cast-transpose kernel. Under sequence parallelism the local shard is cast and the FP8
  rows all-gathered. The column-wise copy is what the backward keeps: 1 byte per element
  of the input instead of 2 (``update_usage(rowwise_usage=False, columnwise_usage=True)``
  before ``save_for_backward``).
- **The output gradient's cast** (``fp8_dy_<linear>``) before the dgrad, the same
  form (E5M2, row-wise for the dgrad, column-wise for the wgrad).
- **The weight's cast** (``fp8_w_<linear>``): row-wise and column-wise FP8 copies
  of the 16-bit weight, kept between micro-batches in TE's weight workspace and renewed when
  ``is_first_microbatch`` is true (``update_ws``), so once per step under Megatron Core
  (``stack.fp8_weight_cast: step``, priced with the optimizer step,
  :func:`step_weight_cast`) or on every forward where the caller passes none
  (``microbatch``). The workspace is memory the rank holds: 2 bytes per linear weight
  (:func:`weight_cache_bytes`). Cast every forward, the weight's FP8 copy is not kept
  between micro-batches, but its column-wise copy is saved for the dgrad: 1 byte per
  weight kept for backward with the micro-batch's activations.
- **Scales**, by recipe (:data:`RECIPES`): ``delayed`` computes each tensor's amax inside
  the cast and updates every scale from its amax history in one fused kernel per pass
  (``reduce_and_update_fp8_tensors``, ``fused_amax_and_scale_update_after_reduction``:
  ``fp8_scale_update``, over ``amax_history_len`` = 1024 entries, TE's default);
  ``current`` reads each input once more for its amax before casting (Float8CurrentScaling
  quantizer: an amax kernel, then the cast); ``blockwise`` (DeepSeek-V3, arXiv:2412.19437
  §3.3: 1x128 activation tiles, 128x128 weight blocks) writes an fp32 scale per 128
  elements with the cast; ``mxfp8`` an E8M0 byte per 32.

DeepSeek-V3's own caching (``stack.fp8_cache: deepseek``; arXiv:2412.19437 §3.3.3,
"Low-Precision Activation": "it is a natural choice to cache activations in FP8 format for
the backward pass of the Linear operator. However, special considerations are taken on
several operators"), two changes to what the backward keeps:

- "(1) Inputs of the Linear after the attention operator. These activations are also used
  in the backward pass of the attention operator, which makes it sensitive to precision.
  We adopt a customized E5M6 data format exclusively for these activations." One copy,
  which the attention's backward reads too, at 12 bits an element: 1.5 bytes
  (:data:`E5M6_BYTES`, two elements packed in three bytes; the report gives no layout, and
  a 12-bit format saves memory over BF16 only packed) where the ``linear_inputs`` default
  counts that tensor once at the FP8 copy's 1 byte.
- "(2) Inputs of the SwiGLU operator in MoE. To further reduce the memory cost, we cache
  the inputs of the SwiGLU operator and recompute its output in the backward pass. These
  activations are also stored in FP8 with our fine-grained quantization method": the
  routed experts' activation inputs at 1 byte (:func:`expert_act_bytes`); the output's
  recomputation is ``parallel.recompute_modules: [moe_act]``. The shared experts, 16-bit
  linears here, and the dense layers' MLPs keep theirs in the training dtype.

Like the FP8 inputs above, the cached tensors are priced without their per-tile scales
(4 bytes per 128 elements under ``blockwise``, 3%); their quantization is memory only here
(no kernel of its own for the E5M6 copy or the SwiGLU inputs' FP8 one).

Left in 16 bits, as TE leaves them: the attention core (no FP8 attention), norms, softmax,
the loss, the output layer (Megatron's ``output_layer`` is not a TE module), the optimizer,
master weights and gradients' reductions. DeepSeek-V3's promotion of partial sums to CUDA
cores every 128 elements of K is inside its GEMM's efficiency (the FP8 curve). The FP8
all-gather of sequence-parallel inputs and the amax all-reduce of delayed scaling are not
priced (tensor-parallel traffic stays 16-bit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from simulator.model.inventory.ops import Op, Pass, Shape, call_shape, mem
from simulator.spec.stack import StackSpec

#: DelayedScaling.amax_history_len's default (transformer_engine/common/recipe/__init__.py)
AMAX_HISTORY = 1024

#: The scaling factors a linear keeps per pass: input, weight, output forward; output
#: gradient, input gradient backward (TE's ``fp8_meta["scaling_fwd"]`` / ``["scaling_bwd"]``).
SCALE_SLOTS = {"fwd": 3, "bwd_input": 2}


@dataclass(frozen=True)
class RecipeCost:
    """What a recipe adds to each cast: an amax pass over its input first (current
    scaling), scale bytes per element written, and amax histories updated once per pass."""

    amax_pass: bool
    scale_bytes: float
    history: bool


#: Recipe -> its cast's extra work (transformer_engine/common/recipe/__init__.py).
RECIPES: dict[str, RecipeCost] = {
    "delayed": RecipeCost(amax_pass=False, scale_bytes=0.0, history=True),
    "current": RecipeCost(amax_pass=True, scale_bytes=0.0, history=False),
    "blockwise": RecipeCost(amax_pass=False, scale_bytes=4.0 / 128, history=False),
    "mxfp8": RecipeCost(amax_pass=False, scale_bytes=1.0 / 32, history=False),
}


#: Bytes of an element kept in DeepSeek-V3's E5M6 format: 1 sign, 5 exponent and 6 mantissa
#: bits, two elements packed in three bytes
E5M6_BYTES = 1.5


def deepseek(stack: StackSpec | None) -> bool:
    """``stack`` runs FP8 linears and caches activations as DeepSeek-V3 does."""
    return on(stack) and stack is not None and stack.fp8_cache == "deepseek"


def attn_out_bytes(stack: StackSpec | None, dt: int) -> float:
    """Bytes a kept element of the input of the linear after the attention takes: the
    training dtype's, 1 as an FP8 linear's copy, :data:`E5M6_BYTES` as DeepSeek-V3's."""
    if not on(stack):
        return float(dt)
    return E5M6_BYTES if deepseek(stack) else 1.0


def expert_act_bytes(stack: StackSpec | None, dt: int) -> float:
    """Bytes a kept element of a routed expert's activation input takes: 1 (FP8) under
    DeepSeek-V3's caching, else the training dtype's."""
    return 1.0 if deepseek(stack) else float(dt)


def active(x: Shape) -> bool:
    """The stack runs its linears in FP8."""
    return x.st.fp8 != "none"


def on(stack: StackSpec | None) -> bool:
    """``stack`` (if any) runs its linears in FP8."""
    return stack is not None and stack.fp8 != "none"


def cast_bytes(recipe: str, elements: float, src: int = 2) -> float:
    """HBM bytes of one cast of ``elements`` ``src``-byte elements to FP8, row-wise and
    column-wise: the input read (twice under current scaling, its amax pass first), two
    FP8 copies and their scales written."""
    r = RECIPES[recipe]
    return elements * (src * (2 if r.amax_pass else 1) + 2 * (1.0 + r.scale_bytes))


def cast(name: str, recipe: str, elements: float, linears: int = 1) -> Op:
    """``linears`` casts of ``elements`` each (two kernels each under current scaling)."""
    kernels = linears * (2 if RECIPES[recipe].amax_pass else 1)
    return Op(name, "memory", 0.0, linears * cast_bytes(recipe, elements), 0.0, "copy",
              kernels)


def linear(name: str, m: float, k: float, n: float, dt: int, cls: str, pass_: Pass,
           kernels: int = 1, saved: float = 0.0, groups: int = 1) -> Op:
    """An FP8 GEMM of an (m×k)·(k×n) linear in ``pass_`` (of ``groups`` experts, one k×n
    weight each, their m rows split among them): two FP8 operands read, the ``dt``-byte
    result written (forward Y m×n, dgrad dX m×k, wgrad dW k×n per group)."""
    flops = 2.0 * m * k * n
    w = groups * k * n
    result = {"fwd": m * n, "bwd_input": m * k, "bwd_weight": w}[pass_]
    operands = m * k + w + m * n - result
    per_call = flops / groups if groups > 1 else flops / kernels  # the curve's lookup
    return Op(name, "gemm", flops, operands + dt * result, per_call, cls, kernels, saved,
              precision="fp8", gemm_call=call_shape(m, k, n, pass_, kernels, groups))


def around(stack: StackSpec | None, name: str, gemm: Op, inputs: float, grads: float,
           weights: float, linears: int, pass_: Pass) -> list[Op]:
    """``gemm`` with its casts, in forward order (the backward reverses the list): the
    input's ``inputs`` elements (per linear) before the forward GEMM, and the weight's
    ``weights`` there too when cast every micro-batch; the output gradient's ``grads``
    elements after it, so before the dgrad in the backward."""
    if stack is None or not on(stack) or pass_ == "bwd_weight":
        return [gemm]
    recipe = stack.fp8
    if pass_ == "bwd_input":
        return [gemm, cast(f"fp8_dy_{name}", recipe, grads)]
    out = [cast(f"fp8_x_{name}", recipe, inputs, linears)]
    if stack.fp8_weight_cast == "microbatch":  # the column-wise copy is kept for the dgrad
        w = cast(f"fp8_w_{name}", recipe, weights / linears, linears)
        out.append(replace(w, saved=weights * (1.0 + RECIPES[recipe].scale_bytes)))
    return [*out, gemm]


def scale_update(x: Shape, linears: int, pass_: Pass) -> list[Op]:
    """Delayed scaling's amax-history roll and scale update of this layer's ``linears``
    FP8 linears in ``pass_`` (read and written, fp32): part of one fused kernel per pass for
    the whole model, so no launch of its own here."""
    if not active(x) or not RECIPES[x.st.fp8].history or pass_ not in SCALE_SLOTS:
        return []
    slots = SCALE_SLOTS[pass_] * linears
    return [mem("fp8_scale_update", 2.0 * slots * (AMAX_HISTORY + 1), 4, "elementwise", 0)]


def step_weight_cast(recipe: str, weights: float, tensors: int) -> Op:
    """The once-per-step cast of ``weights`` linear weight elements in ``tensors`` tensors
    (``stack.fp8_weight_cast: step``)."""
    return cast("fp8_weights", recipe, weights / max(tensors, 1), max(tensors, 1))


def weight_cache_bytes(recipe: str, weights: float) -> float:
    """TE's FP8 weight workspace for ``weights`` linear weight elements: a row-wise and a
    column-wise FP8 copy with their scales."""
    return 2.0 * weights * (1.0 + RECIPES[recipe].scale_bytes)

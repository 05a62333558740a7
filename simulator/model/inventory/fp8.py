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

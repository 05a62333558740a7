"""How the simulator counts the host cost measurement's kernels: the degenerate GPT the
eager host cost is timed on, its step's kernels (and DTensor ops) by part as the
simulator's inventory counts them (:func:`step_counts`), and the per-op seconds two step
times imply (:func:`split_per_op`, :func:`split_gemm`).

:mod:`calibration.measured.host_cost` times the steps and divides by these counts, so a
change to the inventory changes the per-kernel figure the same measurement implies
(``clustersim host-cost --refit``). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the degenerate measured GPT: every kernel is tiny, the step is host cost
HOST_GPT = {"layers": 4, "hidden": 8, "heads": 1, "ffn_hidden": 8, "vocab": 8, "seq_len": 2}
BATCH = 1


#: the second micro-batch count the step is timed at (the first is 1): what a
#: micro-batch's kernels cost and what the optimizer's cost are told apart by the slope
MICRO_BATCHES = 4


@dataclass(frozen=True)
class StepCounts:
    """Kernels (or DTensor ops) of the degenerate step as the simulator counts them."""

    first: int  # the first micro-batch's forward and backward (its grads are stolen)
    later: int  # each later micro-batch's: the first's plus the gradient accumulation
    optimizer: int  # the optimizer step's
    gemm_first: int = 0  # of ``first``, GEMMs (cost classes gemm_*)
    gemm_later: int = 0  # of ``later``, GEMMs

    def total(self, micro_batches: int = 1) -> int:
        return self.first + (micro_batches - 1) * self.later + self.optimizer


def step_counts(sizes: dict[str, int] = HOST_GPT, batch: int = BATCH,
                dtensor: bool = False, device: str = "cpu") -> StepCounts:
    """The step's kernels as the simulator counts them (the measured runs' stack and
    dtype on ``device``, grads set to None before the first micro-batch), by part; with
    ``dtensor`` the ones it dispatches on DTensors under TP with sequence parallelism
    (counted at TP 2: which ops are DTensors does not depend on the mesh size)."""
    from calibration.measured.measure_scenario import stack_for
    from simulator.model import transformer as mdl
    from simulator.model.inventory.layer import layer_tensors
    from simulator.model.inventory.tensor_parallel import dtensor_tensors
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.stack import StackSpec

    stack = StackSpec.model_validate(stack_for(device))
    dtype = "fp32" if device == "cpu" else "bf16"  # the measured runs' (autocast on CUDA)
    spec = ModelSpec.model_validate({**sizes, "kv_heads": sizes["heads"], "activation": "gelu",
                                     "norm": "layernorm", "bias": True,
                                     "tied_embeddings": True, "position": "learned"})
    tp, sp = (2, True) if dtensor else (1, False)
    if dtensor:
        spec = spec.model_copy(update={"heads": 2, "kv_heads": 2})
    first = accum = gemm = gemm_accum = 0
    for pass_ in ("fwd", "bwd_input", "bwd_weight"):
        layer = mdl.layer_ops(spec, batch, tp, sp, dtype, pass_, 0, stack)
        ops = (*layer * spec.layers,) if dtensor else (
            *layer * spec.layers,
            *mdl.embedding_ops(spec, batch, 1, False, dtype, pass_, stack),
            *mdl.head_ops(spec, batch, 1, False, dtype, pass_, stack))
        for op in ops:
            n = op.dtensor if dtensor else op.kernels
            g = n if op.cost_class.startswith("gemm") else 0
            if op.name == "grad_accum":  # the first micro-batch's grads are stolen, not added
                accum, gemm_accum = accum + n, gemm_accum + g
            else:
                first, gemm = first + n, gemm + g
    tensors = spec.layers * layer_tensors(spec, stack) + 4
    dtensors = spec.layers * dtensor_tensors(spec, stack, tp, sp)
    opt = mdl.optimizer_op(1.0, tensors, stack, dtype, dtensors)
    return StepCounts(first, first + accum, opt.dtensor if dtensor else opt.host_ops,
                      gemm, gemm + gemm_accum)


def step_kernels(sizes: dict[str, int] = HOST_GPT, batch: int = BATCH,
                 dtensor: bool = False) -> int:
    """Kernels (``dtensor``: DTensor ops) of a one-micro-batch step (:func:`step_counts`)."""
    return step_counts(sizes, batch, dtensor).total()


def split_per_op(t1: float, tm: float, m: int, counts: StepCounts) -> tuple[float, float]:
    """Seconds per op of the micro-batches and of the optimizer step, from the step's
    time at one micro-batch (``t1``) and at ``m``: ``tm − t1 = (m − 1)·later·x`` and
    ``t1 = first·x + optimizer·y``; each at least 0 (noise can push a difference below)."""
    return _two_terms(t1, tm, m, (counts.first, counts.optimizer), (counts.later, 0))


def split_gemm(t1: float, tm: float, m: int, counts: StepCounts) -> tuple[float, float]:
    """Seconds per GEMM op and per other op (the optimizer's included), from the step's
    time at one micro-batch (``t1``) and at ``m``:
    ``t1 = g₁·x_g + (o₁ + optimizer)·x_o`` and ``(tm − t1) / (m − 1) = g·x_g + o·x_o``
    (``g``, ``o``: a later micro-batch's GEMM and other ops). Where noise drives one
    below 0 it is 0 and the other carries the later micro-batches' cost."""
    return _two_terms(
        t1, tm, m, (counts.gemm_first, counts.first - counts.gemm_first + counts.optimizer),
        (counts.gemm_later, counts.later - counts.gemm_later))


def _two_terms(t1: float, tm: float, m: int, first: tuple[int, int],
               later: tuple[int, int]) -> tuple[float, float]:
    """Per-op seconds (x, y) ≥ 0 of two kinds of op from a step at one micro-batch and
    at ``m``: ``t1 = first₀·x + first₁·y`` and ``(tm − t1)/(m − 1) = later₀·x +
    later₁·y`` (the later micro-batches' ops of each kind). Where the exact solution
    has a term below 0, that term is 0 and the other carries the later micro-batches'
    cost."""
    per = max(tm - t1, 0.0) / (m - 1)
    (a, b), (c, d) = first, later
    det = a * d - b * c
    x, y = ((t1 * d - per * b) / det, (a * per - c * t1) / det) if det else (-1.0, 0.0)
    if x >= 0 and y >= 0:
        return x, y
    if y < 0 and c:
        return per / c, 0.0
    return 0.0, per / d if d else 0.0

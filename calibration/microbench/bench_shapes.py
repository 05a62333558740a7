"""Which GEMM and attention shapes to time: the bundled models' layers, plus a grid.

A transformer layer at tensor-parallel degree t, with T = micro-batch × sequence
tokens, runs these forward GEMMs (C[m, n] = A[m, k] @ B[k, n], 2mnk FLOPs):

    QKV        m=T  n=(a + 2·kv)·d / t   k=h
    out-proj   m=T  n=h                  k=a·d / t
    MLP up     m=T  n=f / t  (×2 SwiGLU) k=h
    MLP down   m=T  n=h                  k=f / t
    logits     m=T  n=V / t              k=h

read off the op inventory itself (:func:`inventory_gemms`: each GEMM op's
``gemm_call``), so the sweep times the shapes the cost model prices (backward GEMMs
have the same FLOPs in transposed layouts, timed by :mod:`bench_terms`). Shapes come
from every bundled model at several TP degrees and micro-batch sizes, and with
``calibrate --scenario`` from that scenario's model, TP degree and micro-batch first,
all of them kept (:func:`scenario_gemm_shapes`). The efficiency a GEMM reaches
depends on its shape as well as its FLOPs (tile and wave quantisation,
:mod:`simulator.system.gemm_shape`); the fit divides each measured shape's
quantisation out, so the curve is the well-quantised one the cost model multiplies
back. On a CPU device, or with a small budget, a shape above the budget's FLOP cap
is scaled down by a power of two in all three dimensions, which keeps its aspect
ratio (a skinny GEMM stays skinny). The selection is spread evenly over log FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from calibration.microbench.bench_timing import Budget
from simulator.model.inventory.ops import CORE_OPS
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec, default_stack

T = TypeVar("T")
TP_DEGREES = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4)


@dataclass(frozen=True)
class GemmShape:
    m: int
    n: int
    k: int
    source: str  # "llama3-8b tp2 mb1 mlp_up (scaled 1/16)" or "grid"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    seq: int
    head_dim: int
    source: str

    @property
    def flops(self) -> float:
        """4·b·a·s²·d: QKᵀ and PV (Megatron's 4bs²h); causal masking is not discounted."""
        return 4.0 * self.batch * self.heads * self.seq**2 * self.head_dim

    @property
    def label(self) -> str:
        return f"b{self.batch}h{self.heads}s{self.seq}d{self.head_dim}"


def _round8(x: float) -> int:
    return max(8, round(x / 8) * 8)


def inventory_gemms(mdl: ModelSpec, tp: int, micro_batch: int,
                    stack: StackSpec | None = None) -> list[tuple[str, int, int, int]]:
    """The forward GEMM calls the op inventory prices for ``mdl`` at TP degree ``tp`` and
    ``micro_batch`` sequences, one per linear, as (name, m, n, k) rounded to whole
    elements: the shapes the cost model looks up (:attr:`Op.gemm_call`), so calibration
    sweeps what the simulator runs. Expert and latent-attention models keep to their
    dense layers' linears and the head (their own GEMMs join with the expert pass)."""
    from simulator.model.inventory.dense import dense_layer_ops
    from simulator.model.transformer import head_ops

    if mdl.heads % tp or mdl.ffn % tp or mdl.vocab % tp:
        return []
    if mdl.is_moe or mdl.mla is not None:
        return []  # expert and latent GEMMs join with the expert workload pass
    ops = [*dense_layer_ops(mdl, micro_batch, tp, False, "bf16", "fwd", stack or default_stack()),
           *head_ops(mdl, micro_batch, tp, False, "bf16", "fwd", stack)]
    return [(op.name, round(c.m), round(c.n), round(c.k)) for op in ops
            if (c := op.gemm_call) is not None and op.name not in CORE_OPS]


def _scale(m: int, n: int, k: int, cap: float) -> tuple[int, int, int, int]:
    """Divide all dims by 2^j (smallest j) so that 2mnk <= cap; returns (m, n, k, 2^j)."""
    j = max(0, math.ceil(math.log2(2.0 * m * n * k / cap) / 3)) if 2.0 * m * n * k > cap else 0
    while True:
        f = 2**j
        mm, nn, kk = _round8(m / f), _round8(n / f), _round8(k / f)
        if 2.0 * mm * nn * kk <= cap or j > 20:
            return mm, nn, kk, f
        j += 1


def _shapes_of(mdl: ModelSpec, name: str, tp: int, mb: int, budget: Budget,
               stack: StackSpec | None = None) -> list[GemmShape]:
    """:func:`inventory_gemms` of one model, TP degree and micro-batch, each scaled under
    the budget's FLOP cap (:func:`_scale`) and tagged with where it came from."""
    out = []
    for layer, m, n, k in inventory_gemms(mdl, tp, mb, stack):
        mm, nn, kk, f = _scale(m, n, k, budget.max_gemm_flops)
        tag = f"{name} tp{tp} mb{mb} {layer}" + (f" (scaled 1/{f})" if f > 1 else "")
        out.append(GemmShape(mm, nn, kk, tag))
    return out


def model_gemm_shapes(budget: Budget, device: str) -> list[GemmShape]:
    """The bundled models' GEMMs at several TP degrees and micro-batches, spread over
    log FLOPs, after the scenario's own (:attr:`Budget.scenario_gemms`, all kept)."""
    from simulator.spec.model_spec import load_preset_model, preset_model_names

    seen: dict[tuple[int, int, int], GemmShape] = {}
    for name in preset_model_names():
        mdl = load_preset_model(name)
        mdl = mdl.model_copy(update={"seq_len": min(mdl.seq_len, 4096 if device == "cuda"
                                                    else 2048)})
        for tp in TP_DEGREES:
            for mb in MICRO_BATCHES:
                for shape in _shapes_of(mdl, name, tp, mb, budget):
                    seen.setdefault((shape.m, shape.n, shape.k), shape)
    own = {(s.m, s.n, s.k): s for s in budget.scenario_gemms}
    rest = [s for key, s in seen.items() if key not in own]
    return [*own.values(), *spread_by_size(rest, budget.gemm_model_shapes, lambda s: s.flops)]


def scenario_gemm_shapes(path: str, budget: Budget) -> tuple[GemmShape, ...]:
    """The GEMMs of scenario ``path``'s model at its TP degree and micro-batch, as its
    stack builds them (``calibrate --scenario``): the shapes its simulation prices."""
    from simulator.spec.load import load_scenario

    s = load_scenario(path)
    shapes = _shapes_of(s.model, Path(path).stem, s.parallel.tp, s.training.micro_batch,
                        budget, s.stack)
    return tuple({(g.m, g.n, g.k): g for g in shapes}.values())


def grid_gemm_shapes(budget: Budget) -> list[GemmShape]:
    """Square, tall and wide GEMMs at powers of two up to the FLOP cap."""
    out: list[GemmShape] = []
    for e in range(5, 16):
        s = 2**e
        for m, n, k in ((s, s, s), (4 * s, s, s), (s, 4 * s, s), (s, s, 4 * s),
                        (s // 4 or 8, s, s)):
            if 2.0 * m * n * k <= budget.max_gemm_flops:
                out.append(GemmShape(m, n, k, "grid"))
    uniq = {(g.m, g.n, g.k): g for g in out}
    return spread_by_size(list(uniq.values()), budget.gemm_grid_shapes, lambda s: s.flops)


def attention_shapes(budget: Budget, device: str) -> list[AttentionShape]:
    from simulator.spec.model_spec import load_preset_model, preset_model_names

    seqs = (1024, 2048, 4096, 8192) if device == "cuda" else (64, 128, 256, 512, 1024)
    seen: dict[tuple[int, int, int, int], AttentionShape] = {}
    for name in preset_model_names():
        mdl = load_preset_model(name)
        if mdl.mla is not None:
            continue  # head widths differ from hidden / heads
        for tp in TP_DEGREES:
            if mdl.heads % tp:
                continue
            heads = mdl.heads // tp
            for s in seqs:
                for b in (1, 2):
                    shape = AttentionShape(b, heads, s, mdl.head_size, f"{name} tp{tp}")
                    while shape.flops > budget.max_gemm_flops and shape.heads > 1:
                        shape = AttentionShape(b, shape.heads // 2, s, mdl.head_size,
                                               f"{name} tp{tp} (heads cut)")
                    if shape.flops <= budget.max_gemm_flops:
                        seen.setdefault((b, shape.heads, s, mdl.head_size), shape)
    return spread_by_size(list(seen.values()), budget.attention_shapes, lambda s: s.flops)


def spread_by_size(items: list[T], count: int, size: Callable[[T], float]) -> list[T]:
    """``count`` items spread evenly over log(size), smallest and largest included."""
    items = sorted(items, key=size)
    if len(items) <= count:
        return items
    lo, hi = math.log(size(items[0])), math.log(size(items[-1]))
    picked: list[T] = []
    used: set[int] = set()
    for i in range(count):
        target = lo + (hi - lo) * i / max(count - 1, 1)
        best = min((j for j in range(len(items)) if j not in used),
                   key=lambda j: abs(math.log(size(items[j])) - target))
        used.add(best)
        picked.append(items[best])
    return sorted(picked, key=size)

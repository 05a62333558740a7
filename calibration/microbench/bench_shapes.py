"""Which GEMM and attention shapes to time: the bundled models' layers, plus a grid.

A transformer layer at tensor-parallel degree t, with T = micro-batch × sequence
tokens, runs these forward GEMMs (C[m, n] = A[m, k] @ B[k, n], 2mnk FLOPs):

    QKV        m=T  n=(a + 2·kv)·d / t   k=h
    out-proj   m=T  n=h                  k=a·d / t
    MLP up     m=T  n=f / t  (×2 SwiGLU) k=h
    MLP down   m=T  n=h                  k=f / t
    logits     m=T  n=V / t              k=h

(backward GEMMs have the same FLOPs in transposed layouts; the cost model keys
efficiency on FLOPs, so forward shapes sample the curve). Shapes come from every
bundled model at several TP degrees and micro-batch sizes. On a CPU device, or
with a small budget, a shape above the budget's FLOP cap is scaled down by a
power of two in all three dimensions, which keeps its aspect ratio (a skinny
GEMM stays skinny). The selection is spread evenly over log FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from calibration.microbench.bench_timing import Budget

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


def _layer_gemms(name: str, tp: int, tokens: int) -> list[tuple[str, int, int, int]]:
    from simulator.spec.model_spec import load_preset_model

    mdl = load_preset_model(name)
    if mdl.heads % tp or mdl.ffn % tp or mdl.vocab % tp:
        return []
    if mdl.is_moe or mdl.mla is not None:
        return []  # expert and latent GEMMs join with the expert workload pass
    d = mdl.head_size
    kv_local = max(mdl.kv // tp, 1)  # KV heads are replicated when tp > kv
    up = mdl.ffn // tp * (2 if mdl.activation == "swiglu" else 1)
    return [
        ("qkv", tokens, (mdl.heads // tp + 2 * kv_local) * d, mdl.hidden),
        ("proj", tokens, mdl.hidden, mdl.heads // tp * d),
        ("mlp_up", tokens, up, mdl.hidden),
        ("mlp_down", tokens, mdl.hidden, mdl.ffn // tp),
        ("logits", tokens, mdl.vocab // tp, mdl.hidden),
    ]


def _scale(m: int, n: int, k: int, cap: float) -> tuple[int, int, int, int]:
    """Divide all dims by 2^j (smallest j) so that 2mnk <= cap; returns (m, n, k, 2^j)."""
    j = max(0, math.ceil(math.log2(2.0 * m * n * k / cap) / 3)) if 2.0 * m * n * k > cap else 0
    while True:
        f = 2**j
        mm, nn, kk = _round8(m / f), _round8(n / f), _round8(k / f)
        if 2.0 * mm * nn * kk <= cap or j > 20:
            return mm, nn, kk, f
        j += 1


def model_gemm_shapes(budget: Budget, device: str) -> list[GemmShape]:
    from simulator.spec.model_spec import load_preset_model, preset_model_names

    seen: dict[tuple[int, int, int], GemmShape] = {}
    for name in preset_model_names():
        seq = min(load_preset_model(name).seq_len, 4096 if device == "cuda" else 2048)
        for tp in TP_DEGREES:
            for mb in MICRO_BATCHES:
                for layer, m, n, k in _layer_gemms(name, tp, mb * seq):
                    mm, nn, kk, f = _scale(m, n, k, budget.max_gemm_flops)
                    tag = f"{name} tp{tp} mb{mb} {layer}" + (f" (scaled 1/{f})" if f > 1 else "")
                    seen.setdefault((mm, nn, kk), GemmShape(mm, nn, kk, tag))
    return spread_by_size(list(seen.values()), budget.gemm_model_shapes, lambda s: s.flops)


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

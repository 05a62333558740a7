"""Fused attention kernels on their own measured curves.

A FlashAttention-style kernel's speed depends on its implementation and release, the
sequence length it runs (how many key blocks each query block's loop covers, and how
unevenly a causal mask spreads that work over the thread blocks), and the head
dimension (the tile shapes); it depends little on the batch once the grid fills the
GPU. So a profile may carry, per kernel (:data:`~simulator.system.units.FusedAttention`),
a curve of achieved / peak over the sequence length for each tabulated head
dimension, for the forward and for the backward: an :class:`AttentionKernel`. The
kernels' authors publish exactly that (FlashAttention-2, Dao 2023, and the
flash-attention repository's ``assets/flash2_*_fwd_bwd_benchmark.png``;
FlashAttention-3, Shah et al. 2024, Figs. 5 and 6: batch × sequence = 16K tokens,
hidden 2048), in TFLOP/s of the FLOPs the kernel executes: the forward's two GEMMs,
the backward's five (it recomputes QKᵀ), a causal kernel's half
(``benchmarks/benchmark_flash_attention.py``, ``flops``).

Between tabulated head dimensions a curve's value is interpolated linearly in
log2(head dimension), and outside them it is the nearest one's; along the sequence
it is the :class:`~simulator.system.curves.EfficiencyCurve`'s log10 interpolation,
flat beyond the ends. A call at head dimension 128 and sequence 4096 on a table
measured there reads the published figure over the datasheet peak.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

from pydantic import Field, field_validator

from simulator.system.curves import EfficiencyCurve
from simulator.system.units import Frozen

AttentionPass = Literal["fwd", "bwd"]


#: Transformer Engine's own choice (``stack.attention: te``, DotProductAttention under
#: ``--attention-backend auto``): where FlashAttention and cuDNN's fused attention both
#: can run, TE prefers cuDNN's on Hopper and later "for performance" and FlashAttention
#: before (transformer_engine/pytorch/attention/dot_product_attention/utils.py,
#: ``get_attention_backend``: "Select FusedAttention for performance")
TE = "te"


def selected_kernel(kernel: str, compute_capability: str | None) -> str:
    """The kernel a call of ``kernel`` runs on a GPU of ``compute_capability``: TE's
    choice resolved (cuDNN from 9.0, FlashAttention-2 below it or where the profile
    does not say), any other kernel itself."""
    if kernel != TE:
        return kernel
    major = int(compute_capability.split(".")[0]) if compute_capability else 0
    return "cudnn" if major >= 9 else "flash2"


class AttentionCall(NamedTuple):
    """What a fused attention call is priced by: its kernel, the sequence length each
    query meets (one chunk's under context parallelism) and the head dimension."""

    kernel: str
    seq_len: float
    head_dim: float


class AttentionKernel(Frozen):
    """One kernel's forward and backward curves, each a curve over sequence length per
    head dimension (achieved / peak of executed FLOPs, causal)."""

    fwd: dict[int, EfficiencyCurve] = Field(min_length=1, max_length=64)
    bwd: dict[int, EfficiencyCurve] = Field(min_length=1, max_length=64)

    @field_validator("fwd", "bwd", mode="before")
    @classmethod
    def _head_dims(cls, data: Any) -> Any:
        """Head dimensions as integers (a JSON dump writes the keys as strings)."""
        if not isinstance(data, dict):
            return data
        out = {}
        for d, curve in data.items():
            dim = int(d) if isinstance(d, str) and d.isascii() and d.isdigit() else d
            if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 4096:
                raise ValueError(f"head dimension {d!r}: an integer in [1, 4096]")
            out[dim] = curve
        return out

    def efficiency(self, pass_: AttentionPass, seq_len: float, head_dim: float) -> float:
        """Achieved / peak of a call of ``seq_len`` and ``head_dim`` in ``pass_``."""
        table = self.fwd if pass_ == "fwd" else self.bwd
        dims = sorted(table)
        if head_dim <= dims[0]:
            return table[dims[0]](seq_len)
        if head_dim >= dims[-1]:
            return table[dims[-1]](seq_len)
        hi = next(d for d in dims if d >= head_dim)
        lo = dims[dims.index(hi) - 1]
        w = (math.log2(head_dim) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return (1.0 - w) * table[lo](seq_len) + w * table[hi](seq_len)

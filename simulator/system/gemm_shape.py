"""GEMM efficiency by shape: tile and wave quantisation on top of the FLOPs curve.

A GPU GEMM C[m×n] = A[m×k]·B[k×n] splits C into output tiles of the CTA tile Tm×Tn the
library picks, one thread block each, and runs them on the SMs in waves (NVIDIA's
"Matrix Multiplication Background User's Guide", DU-09799-001, §2.1 and §3):

- tile quantisation (§3.1): a dimension that is not a multiple of the tile still costs
  whole tiles, ceil(m/Tm)·ceil(n/Tn) of them, each as long as a full one;
- wave quantisation (§3.2): ``tiles`` tiles on ``sms`` SMs take ceil(tiles/sms) waves,
  the last one partly idle.

The useful fraction of the tile slots a launch occupies is the quantisation efficiency

    q = batch·m·n / (waves · sms · Tm·Tn),  waves = ceil(batch·ceil(m/Tm)·ceil(n/Tn) / sms)

(``batch`` products in one launch: a grouped GEMM's experts). q is 1 exactly when m and
n are multiples of the tile and the tiles fill whole waves. cuBLAS picks among several
tiles (§2.3: 256×128 and 128×256 the most efficient); a profile lists the ones it takes
for large GEMMs and the best of them sets q (the library's heuristic avoids a badly
quantising tile where another of the same efficiency fits).

The profile's FLOPs curve (``gpu.gemm_efficiency``) was read from microbenchmarks of
square, well-quantised GEMMs, so it already holds what a GEMM of that size loses by not
filling the GPU at all: a square GEMM of F FLOPs (m = n = k = (F/2)^(1/3)) covers
``fill = min(1, (F/2)^(2/3) / (Tm·Tn·sms))`` of one wave. The shape term is q relative
to that reference, never above 1:

    factor(m, n, k) = min(1, q / fill),   efficiency = curve(F) · factor

so a shape that quantises as well as the reference runs on the curve, one that
quantises worse at the same FLOPs is slower, and none is faster than the curve says.
A profile without tiles (``gpu.gemm_tiles`` empty: a CPU, a calibrated profile written
before the field) prices every GEMM on its FLOPs alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: a CTA output tile, (Tm, Tn) elements of C
Tile = tuple[int, int]


@dataclass(frozen=True)
class GemmCall:
    """The shape of one GEMM call as the kernel runs it: C[m×n] += A[m×k]·B[k×n],
    ``batch`` such products in one launch (a grouped GEMM's experts)."""

    m: float
    n: float
    k: float
    batch: int = 1

    @property
    def flops(self) -> float:
        """2·m·n·k of one product."""
        return 2.0 * self.m * self.n * self.k

    def rows(self, parts: int) -> GemmCall:
        """One of ``parts`` row chunks of this call (m split)."""
        return GemmCall(self.m / parts, self.n, self.k, self.batch)


def tile_count(call: GemmCall, tile: Tile) -> int:
    """Output tiles of one launch: batch · ceil(m/Tm) · ceil(n/Tn)."""
    return call.batch * math.ceil(call.m / tile[0]) * math.ceil(call.n / tile[1])


def wave_count(call: GemmCall, tile: Tile, sms: int) -> int:
    """Waves of thread blocks on ``sms`` SMs: ceil(tiles / sms)."""
    return math.ceil(tile_count(call, tile) / sms)


def quantisation(call: GemmCall, tile: Tile, sms: int) -> float:
    """Useful output over the tile slots of all waves, batch·m·n / (waves·sms·Tm·Tn):
    1 for a perfectly tiled, whole-wave launch, less otherwise."""
    return call.batch * call.m * call.n / (wave_count(call, tile, sms) * sms
                                           * tile[0] * tile[1])


def reference_fill(flops: float, tile: Tile, sms: int) -> float:
    """The share of one wave a square GEMM of ``flops`` FLOPs covers, tiles counted
    without rounding: min(1, (F/2)^(2/3) / (Tm·Tn·sms)), what the FLOPs curve's own
    (square) microbenchmarks already lose to an unfilled GPU."""
    return min(1.0, (flops / 2.0) ** (2.0 / 3.0) / (tile[0] * tile[1] * sms))


def shape_factor(call: GemmCall, size: float, tiles: Sequence[Tile], sms: int) -> float:
    """How much of the FLOPs curve's efficiency at ``size`` (the call's lookup FLOPs) a
    GEMM of shape ``call`` keeps, in (0, 1]: its best tile's quantisation relative to
    the square reference's fill (:func:`reference_fill` on the first tile); 1 without
    tiles or for an empty product."""
    if not tiles or call.m <= 0 or call.n <= 0 or call.k <= 0 or size <= 0:
        return 1.0
    q = max(quantisation(call, tile, sms) for tile in tiles)
    return min(1.0, q / reference_fill(size, tiles[0], sms))

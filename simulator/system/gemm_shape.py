"""GEMM efficiency by shape: tile and wave quantisation on top of the FLOPs curve.

A GPU GEMM C[m×n] = A[m×k]·B[k×n] splits C into output tiles of the CTA tile Tm×Tn the
library picks, one thread block each, and runs them on the SMs in waves (NVIDIA's
"Matrix Multiplication Background User's Guide", DU-09799-001, §2.1 and §3):

- tile quantisation (§3.1): a dimension that is not a multiple of the tile still costs
  whole tiles, ceil(m/Tm)·ceil(n/Tn) of them, each as long as a full one;
- wave quantisation (§3.2): ``tiles`` tiles on ``sms`` SMs take ceil(tiles/sms) waves,
  the last one partly idle.

A launch of ``batch`` products (a grouped GEMM's experts) has batch times the tiles.
cuBLAS picks among several tiles (§2.3: 256×128 and 128×256 the most
efficient); a profile lists the ones it takes for large GEMMs and the best quantising
of them sets the factor.

The profile's FLOPs curve (``gpu.gemm_efficiency``) was read from microbenchmarks of
square, well-quantised GEMMs, so the shape term is 1 wherever a shape quantises
perfectly and what it loses otherwise:

    factor(m, n, k) = padding · waves_term
    padding    = m·n / (ceil(m/Tm)·Tm · ceil(n/Tn)·Tn)   (a side shorter than the tile on
                 a tile cut to it, in steps of 64: the library's smallest tiles)
    waves_term = tiles / (waves · sms)   when tiles >= sms, else 1

so efficiency = curve(F) · factor: a shape that quantises worse than another of the
same FLOPs is slower, none is faster than its FLOPs say. A launch of fewer tiles than
SMs is not charged its idle SMs: the FLOPs curve already holds what a small GEMM loses
by not filling the GPU (its square microbenchmarks are small there too), and a skinny
GEMM with few output tiles and a long k is split along k across thread blocks (split-K,
CUTLASS's media/docs/cpp/efficient_gemm.md "Parallelized Reductions": for M and N small
while K is large the plain tiling "may launch relatively few threadblocks and fail to
make full use of all multiprocessors"). From one full wave on, the partly idle last
wave is charged: the guide's wave quantisation.

A profile without tiles (``gpu.gemm_tiles`` empty: a CPU, a calibrated profile written
before the field) prices every GEMM on its FLOPs alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

#: a CTA output tile, (Tm, Tn) elements of C
Tile = tuple[int, int]

#: The smallest side of a CTA tile the library runs (the guide's §2.3 lists cuBLAS's
#: tiles down to 64×64; cuBLAS's sm_90 kernels include tilesize64x64x64, vLLM's
#: docs/contributing/profiling.md): a side of C shorter than a listed tile's runs on
#: that tile cut to the next multiple of 64, not padded to the full tile.
MIN_SIDE = 64


def fitted(tile: Tile, call: GemmCall) -> Tile:
    """``tile`` with each side cut to C's side rounded up to :data:`MIN_SIDE` where that
    is shorter (a 64-row GEMM runs 64-row tiles, not half-empty 128-row ones)."""
    return (min(tile[0], MIN_SIDE * math.ceil(call.m / MIN_SIDE)),
            min(tile[1], MIN_SIDE * math.ceil(call.n / MIN_SIDE)))


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


def padding(call: GemmCall, tile: Tile) -> float:
    """Tile quantisation: the useful share of the tiles' area, m·n / (ceil(m/Tm)·Tm ·
    ceil(n/Tn)·Tn)."""
    return call.m * call.n / (math.ceil(call.m / tile[0]) * tile[0]
                              * math.ceil(call.n / tile[1]) * tile[1])


def quantisation(call: GemmCall, tile: Tile, sms: int) -> float:
    """Tile times wave quantisation on ``tile`` (:func:`fitted` to a small GEMM):
    :func:`padding` times tiles / (waves · sms) once the launch has at least one full
    wave (below that, 1: split-K fills the SMs, the FLOPs curve holds the rest). 1 for
    perfect tiling in whole waves."""
    tile = fitted(tile, call)
    tiles = tile_count(call, tile)
    waves = tiles / (wave_count(call, tile, sms) * sms) if tiles >= sms else 1.0
    return padding(call, tile) * waves


def shape_factor(call: GemmCall, tiles: Sequence[Tile], sms: int) -> float:
    """How much of the FLOPs curve's efficiency a GEMM of shape ``call`` keeps, in
    (0, 1]: the best of ``tiles`` by :func:`quantisation` (the library's heuristic avoids
    a badly quantising tile where another fits); 1 without tiles or for an empty
    product."""
    if not tiles or call.m <= 0 or call.n <= 0 or call.k <= 0:
        return 1.0
    return max(quantisation(call, tile, sms) for tile in tiles)


def tile_tuples(data: Any) -> Any:
    """A profile's ``gemm_tiles`` as YAML gives them (lists) made the tuples the field
    types (strict validation); anything else unchanged."""
    if isinstance(data, list):
        return tuple(tuple(t) if isinstance(t, list) else t for t in data)
    return data


def checked_tiles(tiles: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """``tiles`` unchanged where every side is a multiple of 8 in [8, 1024] elements; else
    a ValueError naming the first bad tile."""
    bad = [t for t in tiles if not all(8 <= d <= 1024 and d % 8 == 0 for d in t)]
    if bad:
        raise ValueError(f"tile {list(bad[0])}: each side a multiple of 8 in [8, 1024] "
                         "elements (a CTA tile, e.g. [256, 128])")
    return tiles


#: a profile's ``gpu.gemm_tiles``: (Tm, Tn) pairs, YAML's lists made tuples, each side checked
Tiles = Annotated[tuple[tuple[int, int], ...], BeforeValidator(tile_tuples),
                  AfterValidator(checked_tiles)]

"""Layout: rank ↔ (pp, dp, tp) coordinates, node placement and process groups.

Megatron-LM's order with TP innermost: ``rank = pp_idx · (dp · tp) + dp_idx · tp +
tp_idx``. A TP group is ``tp`` consecutive ranks (inside one node whenever tp ≤
GPUs per node), DP peers are ``tp`` apart and pipeline stages ``dp · tp`` apart.
Nodes hold consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Coord:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coord(self, rank: int) -> Coord:
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        return Coord(pp=rank // (self.tp * self.dp), dp=dp, tp=tp)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def tp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(c.pp, c.dp, t) for t in range(self.tp))

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def dp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(c.pp, d, c.tp) for d in range(self.dp))

    def nodes_spanned(self, group: tuple[int, ...]) -> int:
        return len({self.node(r) for r in group})

    def representatives(self) -> tuple[int, ...]:
        """One rank per pipeline stage (dp 0, tp 0): what folded simulation runs."""
        return tuple(self.rank(p, 0, 0) for p in range(self.pp))

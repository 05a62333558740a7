"""Layout: rank ↔ (pp, dp, cp, tp) coordinates, node placement and process groups.

Megatron-LM's order (``megatron/core/parallel_state.py``, tp-cp-ep-dp-pp) with TP
innermost: ``rank = ((pp_idx · dp + dp_idx) · cp + cp_idx) · tp + tp_idx``. A TP
group is ``tp`` consecutive ranks (inside one NVLink domain whenever tp divides the
domain), context-parallel peers are ``tp`` apart, DP peers ``cp · tp`` apart and
pipeline stages ``dp · cp · tp`` apart. Nodes hold consecutive ranks, and NVLink
domains consecutive nodes: a node (``domain_gpus`` 0, the default), or several where
NVLink Switch joins them (a GB200 NVL72 rack), which is what a collective's link
class and its shape (domains spanned, members per domain) go by. The gradient
reduction's group is the data-parallel group *with* context parallelism (every
rank of the stage with the same TP index: CP ranks hold the same weights), as
Megatron's ``get_data_parallel_group(with_context_parallel=True)``. Under hybrid
sharding (``dp_shard`` < dp) ZeRO-3 shards over blocks of ``dp_shard`` consecutive dp
indices (with their cp peers) and replicates across the blocks, as torchtitan's mesh
(pp, dp_replicate, dp_shard, cp, tp) orders them: the shard group and the replicate
group (one rank of each block, the same position in it). Hierarchical context
parallelism (``cp_a2a`` > 1, Megatron-LM's ``--hierarchical-context-parallel-sizes``)
splits a CP group into all-to-all groups of ``cp_a2a`` consecutive CP ranks and rings
of the ranks ``cp_a2a`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

from simulator.system.units import LinkName


@dataclass(frozen=True)
class Coord:
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    cp: int = 1
    domain_gpus: int = 0  # GPUs of one NVLink domain; 0: one node
    dp_shard: int = 0  # dp ranks of a ZeRO-3 shard group; 0: all dp
    cp_a2a: int = 1  # CP ranks of a context-parallel all-to-all group (divides cp)

    @property
    def domain_size(self) -> int:
        return self.domain_gpus or self.gpus_per_node

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def per_stage(self) -> int:
        """Ranks of one pipeline stage: tp · cp · dp."""
        return self.tp * self.cp * self.dp

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def coord(self, rank: int) -> Coord:
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        return Coord(pp=rank // self.per_stage, dp=dp, tp=tp, cp=cp)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def tp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank(c.pp, c.dp, t, c.cp) for t in range(self.tp))

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def dp_group(self, rank: int) -> tuple[int, ...]:
        """The gradient reduction's group: the stage's ranks of this TP index (dp · cp)."""
        c = self.coord(rank)
        return tuple(self.rank(c.pp, d, c.tp, k) for d in range(self.dp) for k in range(self.cp))

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def shard_group(self, rank: int) -> tuple[int, ...]:
        """ZeRO-3's gathers and reduce-scatters: the dp group's ranks in ``rank``'s block
        of ``dp_shard`` consecutive dp indices (the whole dp group without hybrid
        sharding)."""
        c, n = self.coord(rank), self.dp_shard or self.dp
        first = c.dp - c.dp % n
        return tuple(self.rank(c.pp, d, c.tp, k) for d in range(first, first + n)
                     for k in range(self.cp))

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def replicate_group(self, rank: int) -> tuple[int, ...]:
        """Hybrid sharding's all-reduce of a reduced gradient shard: the ranks holding
        ``rank``'s shard in the other blocks (``rank`` alone without hybrid sharding)."""
        c, n = self.coord(rank), self.dp_shard or self.dp
        return tuple(self.rank(c.pp, d, c.tp, c.cp) for d in range(c.dp % n, self.dp, n))

    @cache  # noqa: B019 (a Layout is small, frozen and lives as long as a run)
    def cp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that hold the other chunks of ``rank``'s sequences."""
        c = self.coord(rank)
        return tuple(self.rank(c.pp, c.dp, c.tp, k) for k in range(self.cp))

    def cp_a2a_group(self, rank: int) -> tuple[int, ...]:
        """The ``cp_a2a`` consecutive CP ranks ``rank`` is among (its all-to-all's)."""
        group, a = self.cp_group(rank), self.cp_a2a
        first = group.index(rank) // a * a
        return group[first:first + a]

    def cp_ring_group(self, rank: int) -> tuple[int, ...]:
        """The CP ranks ``cp_a2a`` apart from ``rank`` (its ring's under a2a+p2p, as
        Transformer Engine's ``AttnFuncWithCPAndKVP2P`` orders them: ring neighbours
        ``cp_global_ranks[(r ± 1) % cp_size * cp_size_a2a + rank_a2a]``)."""
        group, a = self.cp_group(rank), self.cp_a2a
        return group[group.index(rank) % a::a]

    def cp_shift(self, k: int, by: int) -> int:
        """CP index ``k`` moved by ``by`` within its all-to-all group and across them
        (a translation that maps every all-to-all group and ring onto one)."""
        a = self.cp_a2a
        return (k // a + by // a) % (self.cp // a) * a + (k % a + by % a) % a

    def domain(self, rank: int) -> int:
        """The NVLink domain of ``rank``: what its NVLink port reaches."""
        return rank // self.domain_size

    def domains_spanned(self, group: tuple[int, ...]) -> int:
        return _domains_spanned(group, self.domain_size)

    def group_link(self, group: tuple[int, ...]) -> str:
        """The slowest link class a collective over ``group`` crosses."""
        return "intra_node" if self.domains_spanned(group) <= 1 else "inter_node"

    def link_class(self, a: int, b: int) -> LinkName:
        """The link class between two ranks: NVLink within a domain, else the network."""
        return "intra_node" if self.domain(a) == self.domain(b) else "inter_node"

    def representatives(self) -> tuple[int, ...]:
        """One rank per pipeline stage (dp 0, tp 0): what folded simulation runs."""
        return tuple(self.rank(p, 0, 0) for p in range(self.pp))


@lru_cache(maxsize=4096)
def _domains_spanned(group: tuple[int, ...], size: int) -> int:
    """How many NVLink domains of ``size`` GPUs ``group`` spans (cached: a planner asks
    it of the same groups candidate after candidate)."""
    return len({r // size for r in group})

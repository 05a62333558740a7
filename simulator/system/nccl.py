"""NCCL's tuning model as data: what each (algorithm, protocol) pair costs. Which pairs
a collective may run with is each algorithm's own entry
(:mod:`simulator.system.collectives`), and the pick is the tuner's
(:mod:`simulator.system.collectives.tuner`), which reads these tables.

Sources (NVIDIA/nccl, re-expressed here, never copied):

- ``src/graph/tuning.cc`` of NCCL **2.20.3** (commit b6475625, ``makefiles/version.mk``
  says 2.20.3): ``baseLat``, ``hwLat``, the protocol refinements of
  ``ncclTopoTuneModel`` and ``treeCorrectionFactor`` / ``ncclTopoGetAlgoTime``. Every
  table below is that release's; other versions change which algorithms exist and,
  before 2.19, NVLS's and NVLS-tree's entries (next item).
- ``src/graph/tuning.cc`` of NCCL **2.18.1** (tag v2.18.1-1, the release torch 2.1's
  CUDA 12.1 wheels pin; 2.18.6 has the same NVLS entries): where 2.18 differs from
  2.19 onwards, NVLS and NVLS-tree. ``baseLat`` of both is 23 µs (Simple);
  ``hwLat[NET]`` 18 (NVLS), 19 (NVLS-tree); NVLS-tree's latency is
  ``baseLat + 2·(nNodes − 1)·hwLat[NET]``, a chain over the nodes, not 2.19's
  ``intraLat + 2·log2i(nNodes)·interLat``; its busBw is ``nChannels`` × bwIntra on up
  to two nodes, × bwInter beyond (one or the other, not their minimum) and its
  algbw ratio ``.70·nNodes / (2·(nNodes − 1))``; NVLS's algbw ratio is .75, not 5/6.
- ``ncclTopoGetAlgoTime`` of every release: the "plateau effect of ring", a multi-node
  ring/Simple all-reduce's latency × 1.9 once it is large enough; 2.17 (v2.17.1-1) ×
  1.5 on compute capability 9.0 and up; from 2.18 (v2.18.1-1) × 1.4 on 8.0 and up, "large
  enough" from ``nBytes / (nChannels · nRanks) >= 64`` (before: ``nBytes >= nRanks / 16
  · 65536``), :func:`ring_plateau`.
- ``src/graph/tuning.cc`` of the releases with ``NCCL_ALGO_PAT`` (2.23 onwards):
  ``ncclPatEnable`` (one rank per node), PAT's bandwidth factor 0.75 and latency
  ``8 + log2(nNodes)·interLat/3.5 + nRanks·2.8`` µs.

What NCCL decides, per collective (``ncclTopoTuneModel``): all-gather and
reduce-scatter run as rings (or PAT from 2.23, one rank per node, Simple only);
broadcast as a ring; all-reduce as a ring or a tree, and on NVSwitch gen 3 as NVLS
(NVLink SHARP, from 2.17, one node; across nodes it needs CollNet, which we do not
model) or NVLS-tree (from 2.18: NVLS in each node, a tree over the NICs). Ring and
tree come in LL, LL128 and Simple, the others in Simple. NCCL's time is
``latency + size / algbw`` and the tuner takes the smallest (the first in its loop
order on a tie: tree, ring, ..., NVLS, NVLS-tree, PAT; LL, LL128, Simple).

How the tables meet ours:

- **Bandwidth**: NCCL's bus bandwidth is ``nChannels × per-channel bandwidth`` of its
  topology search; ours is the link's achieved rate (line rate × efficiency, the
  nccl-tests busbw of a large ring/Simple collective). So channels enter only through
  that busbw and each protocol is a *factor* on the link rate: ring LL 1/4 (1/3 on
  one node for all-gather, reduce-scatter, broadcast), ring LL128 0.92 (0.7 with one
  rank per node), tree 0.92 × (LL 1/3.8, LL128 7/9 on one node and 120/128 across
  nodes) × ``treeCorrectionFactor`` of the size, NVLS 5/6 of the whole buffer
  (NVLS-tree too, and S/k per NIC at 5/6, halved beyond two nodes), PAT 0.75.
  NCCL's per-channel caps (``llMaxBws``, ``perChMaxRingLL128Bws``,
  ``perChMaxTreeBws``) need a channel count and are left out.
- **Latency**: a profile's link α is read as NCCL's ring/Simple per-hop latency on
  that link (``hwLat`` 3.4 µs NVLink, 14 µs network); every other entry of NCCL's
  table, the base latencies included, is scaled by the same ratio ``α / hwLat``, so a
  calibrated or overridden α moves the whole table and α = 0 makes collectives
  latency-free. The network post overhead (1 µs, ×3 for Simple) floors an intra-node
  hop of a multi-node ring, as in NCCL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Protocol = Literal["LL", "LL128", "Simple"]
NcclAlgorithm = Literal["tree", "ring", "nvls", "nvls_tree", "pat"]
Op = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
HwKind = Literal["nvlink", "net"]

PROTOCOLS: tuple[Protocol, ...] = ("LL", "LL128", "Simple")  # NCCL_PROTO_* order
DEFAULT_NCCL_VERSION = "2.18"
PAT_SINCE = (2, 23)  # NCCL_ALGO_PAT first appears in 2.23's tuning.cc
NVLS_SINCE = (2, 17)  # NVLink SHARP all-reduce: NCCL 2.17 release notes
NVLS_TREE_SINCE = (2, 18)  # NVLS + tree across nodes: NCCL 2.18.1 release notes
NVLS_2_19 = (2, 19)  # NVLS and NVLS-tree take the tuning of 2.19.x's tuning.cc

# tuning.cc (2.20.3) ``baseLat``, µs, per algorithm and protocol (LL, LL128, Simple)
BASE_LAT_US: dict[NcclAlgorithm, tuple[float, float, float]] = {
    "tree": (6.8, 14.0, 0.0),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
}
# tuning.cc (2.20.3) ``hwLat``, µs per hop, by hardware (NVLink, NET) and algorithm
HW_LAT_US: dict[HwKind, dict[NcclAlgorithm, tuple[float, float, float]]] = {
    "nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 23.0),
               "nvls_tree": (0.0, 0.0, 23.0)},
    "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
            "nvls_tree": (0.0, 0.0, 14.0)},
}
# the entry a profile's α stands for: ring/Simple per hop
REFERENCE_HOP_US: dict[HwKind, float] = {"nvlink": 3.4, "net": 14.0}
NET_OVERHEAD_US = 1.0  # getNetOverhead: 1 µs on Intel (2 on AMD), ×3 for Simple
LL_INTRA_MULTINODE = 1.8  # ncclTopoTuneModel: LL intra-node hops ×1.8 when nNodes > 1

# ncclTopoTuneModel (2.20.3) protocol refinements of busBw
RING_LL = 1 / 4  # multi-node, or all-reduce
RING_LL_ONE_NODE = 1 / 3  # one node, all-gather / reduce-scatter / broadcast
RING_LL128 = 0.92  # "120.0/128.0" in NCCL's comment; 0.7 when ppn < 2
RING_LL128_ONE_PER_NODE = 0.7
TREE_BW = 0.92  # tree's lower bandwidth than a ring's (busBw × .92)
TREE_LL = 1 / 3.8
TREE_LL128_ONE_NODE = 7 / 9
TREE_LL128 = 120 / 128
NVLS_BW = 5 / 6  # NVLS and NVLS-tree busBw → algbw ratio
NVLS_TREE_INTER = 1 / 2  # NVLS tree over more than 2 nodes: bwInter / 2
# tuning.cc (2.18.1), before NVLS_2_19: NVLS ``ratio = .75``; NVLS-tree
# ``ratio = .70 * nNodes / (2*(nNodes-1))`` of nChannels × (nNodes <= 2 ? bwIntra : bwInter);
# ``baseLat`` {0, 0, 23.0} for both, NVLS-tree ``latencies += 2*(nNodes-1)*hwLat[NET]`` (19)
NVLS_BW_2_18 = 0.75
NVLS_TREE_BW_2_18 = 0.70
NVLS_BASE_US_2_18 = 23.0
NVLS_TREE_NET_US_2_18 = 19.0
# ncclTopoGetAlgoTime: the ring plateau (version, from compute capability, factor), newest
# first; below the capability the oldest factor
RING_PLATEAU: tuple[tuple[tuple[int, int], int, float], ...] = (
    ((2, 18), 80, 1.4), ((2, 17), 90, 1.5))
RING_PLATEAU_OLD = 1.9
RING_PLATEAU_BYTES_PER_CHANNEL_RANK = 64  # from 2.18: nBytes / (nChannels·nRanks) >= 64
RING_PLATEAU_BYTES_PER_RANK = 65536 / 16  # before: nBytes >= nRanks / 16.0 * 65536
# tuning.cc (2.20.3) ``treeCorrectionFactor``: tree bandwidth × factor[log2(size / 64)]
TREE_CORRECTION: dict[Protocol, tuple[float, ...]] = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9),
}
# tuning.cc (2.23+): PAT
PAT_BW = 0.75
PAT_BASE_US = 8.0
PAT_LOG_DIVISOR = 3.5  # log2(nNodes) × interLat / 3.5
PAT_PER_RANK_US = 2.8
# tuning.cc (2.23+): "with ppn=1 latencies are fully exposed": a network hop of a group
# with one rank per node costs hwLat[NET][Tree] of that release (LL, LL128, Simple);
# PAT's interLat is its Simple entry
ONE_PER_NODE_NET_LAT_US = (5.0, 8.5, 14.0)


def parse_version(version: str) -> tuple[int, int]:
    """``"2.18"`` or ``"2.18.3"`` → (2, 18); ValueError naming the value otherwise."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"NCCL version {version!r} is not MAJOR.MINOR[.PATCH], "
                         "e.g. 2.18") from None
    return major, minor


@dataclass(frozen=True)
class Shape:
    """A group as NCCL's tuner sees it: ranks and nodes (one node: NVLink only)."""

    ranks: int
    nodes: int

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes


def bandwidth_factor(algorithm: NcclAlgorithm, protocol: Protocol, op: Op, shape: Shape,
                     size: float, version: str = DEFAULT_NCCL_VERSION) -> float:
    """NCCL's algorithm bandwidth relative to a ring/Simple on the same links (the
    channel-count caps left out, see the module notes). NVLS's applies to the whole
    buffer (its leg carries S; NVLS-tree's NVLink leg too, its network legs
    :func:`nvls_tree_inter_factor`), the others to the ring volumes. NVLS and
    NVLS-tree by ``version``'s tuning (2.18's before 2.19)."""
    if algorithm == "ring":
        if protocol == "LL":
            return RING_LL if shape.nodes > 1 or op == "all_reduce" else RING_LL_ONE_NODE
        if protocol == "LL128":
            return RING_LL128_ONE_PER_NODE if shape.per_node < 2 else RING_LL128
        return 1.0
    if algorithm == "tree":
        proto = {"LL": TREE_LL, "Simple": 1.0,
                 "LL128": TREE_LL128_ONE_NODE if shape.nodes == 1 else TREE_LL128}[protocol]
        return TREE_BW * proto * tree_correction(protocol, size)
    if algorithm == "pat":
        return PAT_BW
    if algorithm == "nvls_tree":
        return nvls_tree_factors(shape, version)[0]
    return NVLS_BW if parse_version(version) >= NVLS_2_19 else NVLS_BW_2_18


def nvls_tree_factors(shape: Shape, version: str = DEFAULT_NCCL_VERSION) -> tuple[float, float]:
    """NVLS-tree's factors on its NVLink leg (S through the NVSwitch port) and its
    network leg (S / k per NIC). From 2.19 both 5/6, the network's halved beyond two
    nodes (``bw = min(bwIntra, nNodes <= 2 ? bwInter : bwInter / 2)``); in 2.18 NCCL
    prices one link only, NVLink on up to two nodes and the network beyond, at
    ``.70·N / (2(N − 1))``, and the other leg runs at its link's rate."""
    if parse_version(version) >= NVLS_2_19:
        return NVLS_BW, NVLS_BW * (NVLS_TREE_INTER if shape.nodes > 2 else 1.0)
    ratio = NVLS_TREE_BW_2_18 * shape.nodes / (2 * (shape.nodes - 1))
    return (ratio, 1.0) if shape.nodes <= 2 else (1.0, ratio)


def nvls_tree_inter_factor(shape: Shape, version: str = DEFAULT_NCCL_VERSION) -> float:
    """NVLS-tree's network share, S / k per NIC: its factor (:func:`nvls_tree_factors`)."""
    return nvls_tree_factors(shape, version)[1]


def tree_correction(protocol: Protocol, size: float) -> float:
    """``treeCorrectionFactor`` at index log2(size / 64) (1 beyond the table)."""
    chunks = int(size) >> 6
    if chunks < 1:
        return TREE_CORRECTION[protocol][0]
    index = chunks.bit_length() - 1
    table = TREE_CORRECTION[protocol]
    return table[index] if index < len(table) else 1.0


def ring_plateau(algorithm: NcclAlgorithm, protocol: Protocol, op: Op, shape: Shape,
                 size: float, version: str, channels: int, compute_capability: int) -> float:
    """``ncclTopoGetAlgoTime``'s "plateau effect of ring": the factor on the latency of a
    ring/Simple all-reduce across nodes of ``size`` bytes (1 otherwise): 1.9, from 2.17
    1.5 on compute capability ≥ 9.0, from 2.18 1.4 on ≥ 8.0; from 2.18 once
    ``size / (channels · ranks)`` reaches 64 bytes, before once ``size`` reaches
    ``ranks / 16 · 65536``. ``compute_capability`` as NCCL's ``minCompCap`` (80 for
    8.0); 0 (unknown) or no ``channels`` leave the latency as it is."""
    if algorithm != "ring" or protocol != "Simple" or op != "all_reduce" \
            or shape.nodes <= 1 or compute_capability <= 0 or channels <= 0:
        return 1.0
    ver = parse_version(version)
    if ver >= (2, 18):
        large = int(size) // (channels * shape.ranks) >= RING_PLATEAU_BYTES_PER_CHANNEL_RANK
    else:
        large = size >= shape.ranks * RING_PLATEAU_BYTES_PER_RANK
    if not large:
        return 1.0
    for since, capability, factor in RING_PLATEAU:
        if ver >= since:
            return factor if compute_capability >= capability else RING_PLATEAU_OLD
    return RING_PLATEAU_OLD


def _index(protocol: Protocol) -> int:
    return PROTOCOLS.index(protocol)


def latency_units(algorithm: NcclAlgorithm, protocol: Protocol, op: Op, shape: Shape,
                  alpha_s: dict[HwKind, float],
                  version: str = DEFAULT_NCCL_VERSION) -> dict[HwKind, float]:
    """NCCL's latency of one collective as multiples of each link's α: base + hops ×
    per-hop latency, split between NVLink and network as ``ncclTopoTuneModel`` does,
    NCCL's µs over its ring/Simple hop on that hardware. Linear in α, so a faster link
    shortens it; ``alpha_s`` only decides where NCCL takes a maximum."""
    us: dict[HwKind, float] = {"nvlink": 0.0, "net": 0.0}
    k, nodes, n = shape.per_node, shape.nodes, shape.ranks
    if algorithm == "pat":
        inter_lat = ONE_PER_NODE_NET_LAT_US[_index("Simple")]
        us["net"] = PAT_BASE_US + _log2i(nodes) * inter_lat / PAT_LOG_DIVISOR \
            + n * PAT_PER_RANK_US
        return _units(us)
    p = _index(protocol)
    intra, inter = HW_LAT_US["nvlink"][algorithm][p], HW_LAT_US["net"][algorithm][p]
    if k == 1 and algorithm != "nvls" and parse_version(version) >= PAT_SINCE:
        inter = ONE_PER_NODE_NET_LAT_US[p]
    if algorithm == "nvls":  # NCCL sets, not adds: intraLat (+ interLat across nodes)
        return _units({"nvlink": intra, "net": inter if nodes > 1 else 0.0})
    us["nvlink" if nodes == 1 else "net"] = BASE_LAT_US[algorithm][p]
    intra_kind: HwKind = "nvlink"
    if nodes > 1 and protocol == "LL":
        intra *= LL_INTRA_MULTINODE
    if algorithm == "nvls_tree" and parse_version(version) < NVLS_2_19:
        # 2.18: base + a chain of 2(N − 1) network hops, not 2.19's tree of 2 log2(N)
        us["net"] = NVLS_BASE_US_2_18 + 2 * (nodes - 1) * NVLS_TREE_NET_US_2_18
        return _units(us)
    if algorithm == "nvls_tree":  # one NVLS hop, 2 log2(N) network hops
        us["nvlink"] += intra
        us["net"] += 2 * _log2i(nodes) * inter
        return _units(us)
    if algorithm == "tree":
        us[intra_kind] += 2 * (k - 1) * intra
        us["net"] += 2 * _log2i(nodes) * inter
        return _units(us)
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
    if nodes > 1:  # an intra-node hop of a multi-node ring waits for the network post
        overhead = NET_OVERHEAD_US * (3 if protocol == "Simple" else 1)
        if _seconds("net", overhead, alpha_s) > _seconds("nvlink", intra, alpha_s):
            intra, intra_kind = overhead, "net"
    us[intra_kind] += (steps - inter_steps) * intra
    us["net"] += inter_steps * inter
    return _units(us)


def latency_s(algorithm: NcclAlgorithm, protocol: Protocol, op: Op, shape: Shape,
              alpha_s: dict[HwKind, float], version: str = DEFAULT_NCCL_VERSION) -> float:
    """:func:`latency_units` in seconds on links of α ``alpha_s``."""
    units = latency_units(algorithm, protocol, op, shape, alpha_s, version)
    return sum(units[hw] * alpha_s[hw] for hw in units)


def _units(us: dict[HwKind, float]) -> dict[HwKind, float]:
    return {hw: us[hw] / REFERENCE_HOP_US[hw] for hw in us}


def _seconds(hw: HwKind, us: float, alpha_s: dict[HwKind, float]) -> float:
    return us / REFERENCE_HOP_US[hw] * alpha_s[hw]


def _log2i(x: int) -> int:
    """NCCL's ``log2i``: floor(log2 x), 0 for x ≤ 1."""
    return max(x, 1).bit_length() - 1


def pat_steps(nodes: int) -> int:
    """PAT's (Bruck-like) exchange rounds, for the step-by-step expansion only."""
    return max(1, math.ceil(math.log2(nodes)))

"""DeepEP's normal (high-throughput) dispatch and combine kernels as a collective plan.

DeepEP (github.com/deepseek-ai/DeepEP, ``docs/legacy.md``, "Normal kernels with NVLink
and RDMA forwarding") sends each token once to every *rank* that holds one of its
experts, not once per expert, and internode it takes the path DeepSeek-V3 describes
(arXiv:2412.19437, §3.2.2): over InfiniBand to the GPU of the same index on each target
node, once per node, then over NVLink to the target GPUs within it, the two pipelined
in one kernel. Megatron-LM runs it over the expert-TP × EP group, every expert-TP rank
of a target EP rank receiving the token
(megatron/core/transformer/moe/token_dispatcher.py, ``MoEFlexTokenDispatcher
._initialize_metadata``).

**Bytes.** With a token's k experts drawn evenly from E (a balanced router), the
expected number of distinct groups among them when the experts split evenly into g
groups is g · (1 − Π_{i<k} (E − E/g − i)/(E − i)) (:func:`distinct`). Per rank and
exchange, with T the tokens it routes, h·bytes per token and the load factor of the
busiest rank:

- NVLink: every copy (distinct EP ranks × expert TP) but the one that lands on the
  forwarding GPU itself: T·h·bytes·load · copies · (k − 1)/k, k the group's GPUs per node;
- RDMA: one copy per other target node: T·h·bytes·load · nodes_hit · (N − 1)/N.

**Rates.** DeepEP's measured bottleneck bandwidths (H800, ~160 GB/s NVLink; CX7
InfiniBand 400 Gb/s, ~50 GB/s; DeepSeek-V3's pretraining setting: 4,096 tokens,
hidden 7,168, top-8) over those maxima give each leg's share of the profile's link
rate (:data:`NORMAL_GBPS`), capped at 1 (the RDMA figures above 50 GB/s are DeepEP's
"logical" bandwidth, which counts traffic a rank keeps): intranode 153 GB/s dispatch,
158 GB/s combine; internode by the group's ranks, the nearest measured size at or
below it. Both legs of a plan run together (one phase, one latency step).

The kernels hold :data:`NUM_SMS` SMs for their whole run (``Buffer.set_num_sms``, 20 by
default and in Megatron; DeepSeek-V3 §3.2.2: "only 20 SMs are sufficient to fully utilize
the bandwidths of IB and NVLink"): the plan says so (``Plan.sms``) and the engine runs
the rank's compute beside it on the other ``gpu.sms`` − 20 (the compute slowed by
gpu.sms / (gpu.sms − 20), :mod:`simulator.engine.interference`). Not modelled: a
profile's calibrated all-to-all (``hw.collectives``), measured for NCCL, replaces these
rates as it does any all-to-all's.
"""

from __future__ import annotations

from typing import Literal

from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan

Direction = Literal["dispatch", "combine"]

#: DeepEP's stated link maxima in the measurement (GB/s): NVLink, RDMA.
NVLINK_MAX_GBPS, RDMA_MAX_GBPS = 160.0, 50.0
#: Measured bottleneck bandwidth (GB/s) of the normal kernels, docs/legacy.md's table:
#: intranode (NVLink) at EP 8, internode (RDMA) by EP size; (dispatch, combine).
NORMAL_GBPS: dict[str, dict[int, tuple[float, float]]] = {
    "intra_node": {8: (153.0, 158.0)},
    "inter_node": {16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)},
}


def distinct(groups: int, experts: int, k: int) -> float:
    """Expected distinct groups among k of ``experts`` experts drawn without
    replacement, the experts split evenly into ``groups`` groups."""
    if groups <= 1:
        return float(groups)
    per = experts / groups
    miss = 1.0
    for i in range(k):
        miss *= max(experts - per - i, 0.0) / (experts - i)
    return groups * (1.0 - miss)


def rate_factor(link: str, ranks: int, direction: Direction) -> float:
    """A leg's share of its link's rate: DeepEP's measured bandwidth at the nearest
    measured group size at or below ``ranks`` (the smallest above it where none is
    below) over the stated maximum, at most 1."""
    table = NORMAL_GBPS[link]
    below = [n for n in table if n <= ranks]
    size = max(below) if below else min(table)
    gbps = table[size][0 if direction == "dispatch" else 1]
    peak = NVLINK_MAX_GBPS if link == "intra_node" else RDMA_MAX_GBPS
    return min(1.0, gbps / peak)


def deepep_plan(direction: Direction, token_bytes: float, experts: int, k: int, ep: int,
                shape: GroupShape) -> Plan:
    """One dispatch or combine on a group of ``shape`` (expert TP × EP ranks) for a rank
    sending ``token_bytes`` (its tokens' bytes times the busiest rank's load): the
    NVLink and RDMA legs of the module docstring, at DeepEP's measured rates."""
    etp = shape.n // ep
    copies = distinct(ep, experts, k) * etp
    legs = []
    if shape.per_node > 1:
        legs.append(Leg("intra_node", token_bytes * copies * (shape.per_node - 1)
                        / shape.per_node, rate_factor("intra_node", shape.n, direction)))
    nodes = shape.nodes
    if nodes > 1:
        hit = distinct(nodes, experts, k)
        legs.append(Leg("inter_node", token_bytes * hit * (nodes - 1) / nodes,
                        rate_factor("inter_node", shape.n, direction)))
    return Plan("all_to_all", "deepep", token_bytes * copies, shape.n, (Phase(tuple(legs), 1),),
                sms=NUM_SMS)


# ---------------------------------------------------------------- buffers

#: DeepEP V1's recommended configs (deep_ep/buffers/legacy.py, Buffer.get_dispatch_config
#: and get_combine_config) by group size: (NVLink chunked recv tokens, RDMA chunked recv
#: tokens); the buffer is sized for the larger of dispatch's and combine's.
CONFIG_RECV_TOKENS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {
    2: ((256, 128), (256, 128)), 4: ((256, 128), (256, 128)), 8: ((256, 128), (256, 128)),
    16: ((288, 128), (288, 128)), 24: ((288, 128), (288, 128)), 32: ((288, 128), (288, 128)),
    48: ((288, 128), (288, 128)), 64: ((288, 128), (288, 128)), 96: ((480, 128), (480, 128)),
    128: ((560, 128), (560, 128)), 144: ((720, 128), (720, 128)),
    160: ((720, 128), (720, 128)),
}
NUM_SMS = 20  # Buffer.num_sms, and Megatron's default (token_dispatcher.py _DeepepManager)
NVL_PEERS = 8  # LEGACY_NUM_MAX_NVL_PEERS (csrc/kernels/legacy/compiled.cuh)
MAX_TOPK = MAX_SCALES = 128  # kNumMaxTopK, kNumMaxScales (csrc/legacy/config.hpp)
SOURCE_META, TOPK_IDX, F32, INT, INT4 = 8, 8, 4, 4, 16  # bytes (internode.cu SourceMeta)


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def buffer_bytes(hidden_bytes: int, ranks: int) -> int:
    """The NVLink and RDMA buffers DeepEP's ``Buffer`` holds on each rank of a group of
    ``ranks`` (csrc/legacy/config.hpp ``get_nvl_buffer_size_hint`` and
    ``get_rdma_buffer_size_hint`` with 20 SMs), Megatron passing hidden ×
    max(element size, 2) bytes per token (fused_a2a.py ``get_hidden_bytes``); a group
    size without a recommended config takes the next one up."""
    size = min((n for n in CONFIG_RECV_TOKENS if n >= ranks), default=max(CONFIG_RECV_TOKENS))
    nvl_recv = max(c[0] for c in CONFIG_RECV_TOKENS[size])
    rdma_recv = max(c[1] for c in CONFIG_RECV_TOKENS[size])
    channels, rdma_ranks = NUM_SMS // 2, max(ranks // NVL_PEERS, 1)
    nvl_ranks = min(ranks, NVL_PEERS)
    per_token = hidden_bytes + SOURCE_META + MAX_TOPK * (TOPK_IDX + F32) + MAX_SCALES * F32
    nvl = _round128(channels * nvl_ranks * ((2 * rdma_ranks + 3) * INT
                                            + nvl_recv * per_token))
    if ranks <= NVL_PEERS:
        return nvl
    rdma = _round128(channels * rdma_ranks * 2 * ((NVL_PEERS * 2 + 2) * INT
                                                  + rdma_recv * (per_token + INT4)))
    return nvl + rdma

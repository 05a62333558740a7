"""A flat ring across nodes: every link of a channel's ring carries the ring's whole
per-rank volume, so each of a node's k NICs carries busbw(n)·S/k, not the node's share
busbw(N)·S/k that a tree or a hierarchical algorithm puts on it
(simulator/system/collectives/ring.py).

The oracle is NCCL's own model (NVIDIA/nccl ``src/graph/tuning.cc``
``ncclTopoTuneModel``, v2.18.1-1 and v2.20.3-1): a ring's algorithm bandwidth is
``busBw · nRanks / nsteps`` with ``busBw = nChannels · bwInter`` beyond two nodes, so
its time is ``nsteps / nRanks · S`` over the node's NICs, whatever the node count.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.plan import GroupShape
from simulator.system.profiles import load_system

HW = load_system("dgx-a100-80gb")
NSTEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
          "reduce_scatter": lambda n: n - 1}  # tuning.cc: nsteps per collective


def nic_bytes(algorithm: str, op: str, size: float, shape: GroupShape) -> float:
    plan = make_plan(op, size, shape, algorithm, HW)
    return sum(leg.bytes_per_rank for phase in plan.phases for leg in phase.legs
               if leg.link_class == "inter_node")


@pytest.mark.parametrize("op", sorted(NSTEPS))
@pytest.mark.parametrize("per_node,nodes", [(8, 3), (8, 16), (8, 64), (4, 32), (2, 5)])
def test_ring_nic_time_is_nccl_ring_model(op, per_node, nodes):
    """Beyond two nodes NCCL prices a ring at nChannels · bwInter, the node's NICs (k of
    them, one rate each), times nRanks / nsteps: S · nsteps / nRanks / (k · B) seconds
    on the network, the ring's NIC leg over one NIC's rate."""
    n, size = per_node * nodes, 512e6
    rate = HW.link("inter_node").bytes_per_s
    nccl_seconds = size * NSTEPS[op](n) / n / (per_node * rate)
    assert nic_bytes("ring", op, size, GroupShape(n, per_node)) / rate \
        == pytest.approx(nccl_seconds, rel=1e-12)


def test_two_node_ring_moves_nearly_twice_the_node_share():
    """2 nodes of 8: a ring all-gather puts 15/16 · S / 8 on each NIC (the node's own
    chunks go round through the other node), a hierarchical one 1/2 · S / 8."""
    shape, size = GroupShape(16, 8), 1e9
    assert nic_bytes("ring", "all_gather", size, shape) == pytest.approx(15 / 16 * size / 8)
    assert nic_bytes("hierarchical", "all_gather", size, shape) \
        == pytest.approx(1 / 2 * size / 8)


@pytest.mark.parametrize("nodes", [2, 4, 64])
def test_tree_keeps_the_node_share(nodes):
    """The tree reduces within the node before the trees between nodes: 2(N-1)/N · S/k
    per NIC (its textbook plan and NCCL's tree plans alike)."""
    k, size = 8, 256e6
    expected = 2 * (nodes - 1) / nodes * size / k
    assert nic_bytes("tree", "all_reduce", size, GroupShape(k * nodes, k)) \
        == pytest.approx(expected, rel=1e-12)


@given(op=st.sampled_from(sorted(NSTEPS)), per_node=st.integers(1, 8),
       nodes=st.integers(2, 128), size=st.floats(1e3, 1e10))
def test_ring_nic_bytes_never_below_the_node_share(op, per_node, nodes, size):
    """A flat ring never moves less over a NIC than the node's share (the hierarchical
    algorithm's), equal with one rank per node, and one more node never lowers it."""
    shape = GroupShape(per_node * nodes, per_node)
    ring = nic_bytes("ring", op, size, shape)
    share = (2 if op == "all_reduce" else 1) * (nodes - 1) / nodes * size / per_node
    if per_node == 1:
        assert ring == pytest.approx(share, rel=1e-12)
    else:
        assert ring > share
    more = nic_bytes("ring", op, size, GroupShape(per_node * (nodes + 1), per_node))
    assert more >= ring * (1 - 1e-12)

"""One cluster's fabric shared by several jobs: GPU ports, leaf groups and their uplinks.

The cluster's nodes are numbered 0 .. nodes − 1 and its GPUs ``node · gpus_per_node +
index``. Consecutive nodes form leaf groups of ``nodes_per_leaf`` (a rail-optimised
scalable unit: one leaf switch per rail, the GPUs of one index on every node of the
group hang off the same leaf). Inside a group the fabric is non-blocking. A flow from a
GPU to a GPU of another group leaves through its rail's uplink out of the sender's
group, link ``("up", leaf, rail)``, whose capacity is the group's NIC bandwidth on that
rail (``nodes_per_leaf`` × one GPU's NIC rate) divided by the ``oversubscription``:
the taper of a fat-tree. At 1 the uplinks are never the bottleneck and are not
modelled, as a single job's non-blocking fabric (:mod:`simulator.system.topology`).

Like the single job's oversubscribed core, every member of a collective whose group
spans more than one leaf counts on its leaf's uplink: a flow occupies the sender's
egress, and a ring's hops carry equal bytes. That is an upper bound on a ring's
traffic out of a leaf (a ring ordered by node leaves each leaf once) and what an
all-to-all puts there.

Each job keeps its own rank numbering (its layout, its programs); a
:class:`PlacedTopology` maps its ranks onto the cluster's GPUs, so the links its flows
name are the cluster's. Jobs hold whole nodes, never the same one, so a GPU's NVSwitch
port and NIC are one job's: jobs meet on the uplinks only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.network import Route
from simulator.system.topology import LinkId, Topology
from simulator.system.units import LinkName


@dataclass(frozen=True)
class FabricShape:
    """The cluster's size and its fabric's taper."""

    nodes: int
    gpus_per_node: int
    nodes_per_leaf: int
    oversubscription: float  # the leaf uplinks' taper (1 = non-blocking)
    nic_Bps: float  # one GPU's NIC rate, bytes/s (the system's inter-node link)

    @property
    def oversubscribed(self) -> bool:
        return self.oversubscription > 1.0

    @property
    def uplink_Bps(self) -> float:
        """Capacity of one rail's uplink out of one leaf group."""
        return self.nodes_per_leaf * self.nic_Bps / self.oversubscription

    def leaf(self, node: int) -> int:
        return node // self.nodes_per_leaf


def uplink(leaf: int, rail: int) -> LinkId:
    return ("up", leaf, rail)


class Fabric:
    """The links of the whole cluster: what a shared network asks for their capacity
    and which of them several flows' members share."""

    def __init__(self, shape: FabricShape) -> None:
        self.shape = shape
        self.ports: dict[LinkId, float] = {}  # a placed GPU's port -> its capacity
        self.owner: dict[int, int] = {}  # a placed GPU -> the job holding it

    def capacity(self, link: LinkId) -> float:
        if link[0] == "up":
            return self.shape.uplink_Bps
        return self.ports[link]

    @staticmethod
    def shared(link: LinkId) -> bool:
        return link[0] == "up"

    def job_of(self, link: LinkId) -> int:
        """The job whose GPU a port is (a port, not an uplink)."""
        gpu = link[1]
        assert isinstance(gpu, int)
        return self.owner[gpu]


class PlacedTopology(Topology):
    """One job's ranks on the cluster's nodes ``nodes`` (the job's node i is the
    cluster's ``nodes[i]``): the links its flows cross, named as the cluster names them."""

    def __init__(self, layout: Layout, hw: HardwareProfile, fabric: Fabric,
                 nodes: Sequence[int], job: int,
                 degraded: Mapping[tuple[int, str], float] | None = None) -> None:
        super().__init__(layout, hw, degraded)
        shape = fabric.shape
        if layout.gpus_per_node > shape.gpus_per_node:
            raise ValueError(f"{layout.gpus_per_node} GPUs per node on a cluster of "
                             f"{shape.gpus_per_node}")
        self.fabric, self.shape, self.nodes, self.job = fabric, shape, tuple(nodes), job
        self.oversubscribed = False  # the single job's core: the fabric's uplinks instead
        per = layout.gpus_per_node
        self.gpus = [self.nodes[r // per] * shape.gpus_per_node + r % per
                     for r in range(layout.world)]
        self.leaves = [shape.leaf(self.nodes[r // per]) for r in range(layout.world)]
        for r, gpu in enumerate(self.gpus):
            fabric.owner[gpu] = job
            for kind in ("nvl", "nic"):
                fabric.ports[(kind, gpu)] = super().capacity((kind, r))

    def _port(self, rank: int, link_class: LinkName) -> LinkId:
        return ("nvl" if link_class == "intra_node" else "nic", self.gpus[rank])

    def _uplink(self, rank: int) -> LinkId:
        return uplink(self.leaves[rank], rank % self.layout.gpus_per_node)

    def links(self, rank: int, link_class: LinkName) -> tuple[LinkId, ...]:
        return (self._port(rank, link_class),)

    def group_links(self, members: Sequence[int], link_class: LinkName) -> tuple[LinkId, ...]:
        """Every member's port; across leaves of an oversubscribed fabric also each
        member's uplink, loaded with the members behind it."""
        ports = tuple(dict.fromkeys(self._port(r, link_class) for r in members))
        if (link_class != "inter_node" or not self.shape.oversubscribed
                or len({self.leaves[r] for r in members}) < 2):
            return ports
        behind: dict[LinkId, float] = {}
        for r in members:
            up = self._uplink(r)
            behind[up] = behind.get(up, 0.0) + 1.0
        return Route((*ports, *behind), (1.0,) * len(ports) + tuple(behind.values()))

    def send_links(self, src: int, dst: int, link_class: LinkName) -> tuple[LinkId, ...]:
        links: tuple[LinkId, ...] = (self._port(src, link_class),)
        if (link_class == "inter_node" and self.shape.oversubscribed
                and self.leaves[src] != self.leaves[dst]):
            links = (*links, self._uplink(src))
        kind = "nvl" if link_class == "intra_node" else "nic"
        if self.degraded.get((kind, dst), 1.0) < 1.0:
            links = (*links, self._port(dst, link_class))
        return links

    def own(self, busy: Mapping[LinkId, float]) -> dict[LinkId, float]:
        """This job's ports' busy seconds (the uplinks are the fabric's)."""
        mine = set(self.gpus)
        return {link: s for link, s in busy.items() if link[0] != "up" and link[1] in mine}

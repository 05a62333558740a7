"""Topology: the links a transfer crosses and how fast each one is.

Each GPU has an NVSwitch port (the ``intra_node`` class: to every GPU of its NVLink
domain, one node or a rack's trays, per direction) and a rail NIC
(inter-node, one per GPU; with fewer NICs than GPUs each GPU gets its share of
the node's NIC bandwidth). NVSwitch and a non-blocking fat-tree are full-duplex
and never the bottleneck, so a flow occupies the *sender's* egress port; ring
collectives are symmetric, so egress is where their time goes. With an
oversubscribed fabric (``oversubscription`` > 1) every inter-node flow also
crosses one shared core link whose capacity is the sum of all NICs divided by
the oversubscription factor.

A degraded port (``variability.slow_links``) runs at a fraction of its class's
rate. A point-to-point transfer into a degraded port also crosses that port, so
the slower end bounds it (a healthy receiver is not charged, as above).

A link id is a plain tuple: ``("nvl", rank)``, ``("nic", rank)`` or ``("core",)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.units import LinkName

LinkId = tuple[object, ...]
CORE: LinkId = ("core",)


class Topology:
    def __init__(self, layout: Layout, hw: HardwareProfile,
                 degraded: Mapping[tuple[int, str], float] | None = None) -> None:
        self.layout = layout
        self.hw = hw
        # (rank, link class) -> bandwidth factor of a degraded port
        self.degraded: dict[LinkId, float] = {
            (("nvl" if cls == "intra_node" else "nic"), r): f
                         for (r, cls), f in (degraded or {}).items()}
        self.intra_rate = hw.intra_node.bytes_per_s
        self.inter_rate = hw.inter_node.bytes_per_s
        self.oversubscribed = hw.inter_node.oversubscription > 1.0
        self.core_rate = self.inter_rate * layout.world / hw.inter_node.oversubscription

    def capacity(self, link: LinkId) -> float:
        kind = link[0]
        if kind == "core":
            return self.core_rate
        rate = self.intra_rate if kind == "nvl" else self.inter_rate
        return rate * self.degraded.get((kind, link[1]), 1.0) if self.degraded else rate

    @staticmethod
    def shared(link: LinkId) -> bool:
        """Links several ranks' flows cross (the core); the others are one rank's own."""
        return link[0] == "core"

    def rate(self, link_class: LinkName) -> float:
        return self.intra_rate if link_class == "intra_node" else self.inter_rate

    def alpha(self, link_class: LinkName) -> float:
        return self.hw.link(link_class).alpha_s

    def links(self, rank: int, link_class: LinkName) -> tuple[LinkId, ...]:
        """The links a flow from ``rank`` over ``link_class`` occupies."""
        if link_class == "intra_node":
            return (("nvl", rank),)
        if self.oversubscribed:
            return (("nic", rank), CORE)
        return (("nic", rank),)

    def group_links(self, members: Sequence[int], link_class: LinkName) -> tuple[LinkId, ...]:
        """Every member's link of a class, shared links once: a ring moves in lock-step,
        so one flow over all of them proceeds at the slowest member's share."""
        seen: dict[LinkId, None] = {}
        for r in members:
            seen.update(dict.fromkeys(self.links(r, link_class)))
        return tuple(seen)

    def own(self, busy: Mapping[LinkId, float]) -> dict[LinkId, float]:
        """Of a network's busy seconds by link, this topology's links (all of them: a
        topology alone on its network)."""
        return dict(busy)

    def send_links(self, src: int, dst: int, link_class: LinkName) -> tuple[LinkId, ...]:
        """The links a point-to-point transfer occupies: the sender's, plus the
        receiver's port when that one is degraded."""
        links = self.links(src, link_class)
        port = ("nvl" if link_class == "intra_node" else "nic", dst)
        return (*links, port) if self.degraded.get(port, 1.0) < 1.0 else links

    def link_class(self, a: int, b: int) -> LinkName:
        return self.layout.link_class(a, b)

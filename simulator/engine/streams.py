"""The SimPy processes: one per (simulated rank, stream), walking its compiled steps.

A step waits for its dependencies (events of other tasks), then:

- a compute run holds the stream for its durations summed in order (or, under
  interference, for as long as its work takes at the rank's changing pace);
- a collective registers its member's arrival at the rendezvous of its group (the
  transfer starts at the latest arrival; the last member to register runs it, the
  others wait for its end: one timeout per collective, not per member), then runs its
  plan phase by phase (:meth:`simulator.engine.engine.Engine.transfer`);
- a point-to-point send is one flow over the links between the two ranks.

This is the engine's hottest loop: SimPy's classes are called directly
(``env.timeout`` makes a bound method per call) and the clock is read from ``_now``
(``now`` is a property). Nothing here knows what a transformer is.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import simpy
from simpy.events import AllOf, Event, Timeout

from simulator.engine.chains import DONE, calm, forward, gate
from simulator.engine.compile import RUN, SEND, Instance

if TYPE_CHECKING:
    from simulator.engine.engine import Engine

Process = Generator[simpy.Event, Any, None]


class Rendezvous:
    """The members of one collective so far: how many arrived, when the latest will,
    which task that is, and the longest compute burst a member arrives from."""

    __slots__ = ("arrived", "burst", "done", "last", "members", "start")

    def __init__(self, env: simpy.Environment, members: int) -> None:
        self.members = members
        self.arrived = 0
        self.done = Event(env)
        self.start = 0.0
        self.last = -1
        self.burst = 0.0  # the longest compute burst a member arrives from


def waits(e: Engine, inst: Instance, deps: tuple[Any, ...]) -> list[simpy.Event]:
    """The events of ``deps`` that have not fired yet."""
    event_of = e.event_of
    if e.w.shared is None:  # task ids
        pending = [event_of(d) for d in deps]
    else:  # (owner, local index): the owner's peer of this rank's
        ids_of, delta = e.ids_of, inst.delta
        pending = [event_of(ids_of[owner + delta][local]) for owner, local in deps]
    return [ev for ev in pending if not ev.triggered]


def joined(env: simpy.Environment, pending: list[simpy.Event]) -> simpy.Event:
    """An event that fires once every one of ``pending`` has fired, scheduled as
    ``AllOf`` schedules itself (by the last one's callback, at its place among them):
    for one event a plain event its callback succeeds, without the condition's value."""
    if len(pending) != 1:
        return AllOf(env, pending)
    ev = Event(env)
    pending[0].callbacks.append(ev.succeed)  # type: ignore[arg-type]
    return ev


def stream(e: Engine, inst: Instance, steps: list[tuple[Any, ...]],
           offsets: tuple[list[int], list[int]], name: str = "compute") -> Process:
    """The process of one stream of one simulated rank: its steps, each moved by its
    offsets (positions, run indices: :class:`simulator.engine.blocks.Blocks`)."""
    env, ids, totals, run_t0 = e.env, inst.ids, inst.totals, e.run_t0
    starts, ends, base, event_of, got = e.start, e.end, inst.run_base, e.event_of, e.events.get
    slowing, rank, groups = e.interference is not None, inst.rank, inst.groups
    counts, busy, _ = e.burst_counters(rank, name)  # compute bursts (a sync cost)
    gates, sharers, own = gating(e, rank, name)
    chained = e.chains and (gates is None or name == "compute")
    (i, n), (po, ro) = (0, len(steps)), offsets
    laid = inst.template.laid[inst.template.stream_names.index(name)] or None
    plain = (by_id := e.w.shared is None) and not slowing  # deps as ids, sends to dst
    while i < n:
        kind, deps, a, b, g, tail, dependents, lead = steps[i]
        if kind == RUN:  # the copy's offsets: runs by ``ro``, tasks by ``po``
            a, b = a + ro[i], (b + po[i] if b >= 0 else b)
        else:
            a, lead = a + po[i], (lead + ro[i] if lead >= 0 else lead)
        if deps and (pending := [w for d in deps if not (w := got(d) or event_of(d)).triggered]
                     if by_id else waits(e, inst, deps)):  # :func:`waits`, inline
            if own is not None:  # what it waits for shown to the compute stream's chains
                yield from wait_for(e, inst, deps, pending, own, name)
            else:
                yield joined(env, pending)
        if chained and kind != SEND and (gates is None or calm(gates)):  # one event
            j, ev = forward(e, inst, steps, offsets, i, laid,
                            sharers is None or calm(sharers))
            if j > i:
                if ev is not None:
                    yield ev
                if (last := steps[j - 1])[6] or (last[0] == RUN and last[3] >= 0):
                    ended(e, inst, last, po[j - 1], ro[j - 1])  # someone waits for it
                i = j
                continue
        i += 1
        if kind == RUN:  # a: the run, b: its last task when someone waits for it,
            t0 = env._now  # g: whether interference may slow it
            total = totals[a]
            if counts:
                busy[rank] += total
            if total > 0:
                yield e.interference.slow_run(  # type: ignore[union-attr]
                    rank, base + a, total) if slowing and g else Timeout(env, total)
            run_t0[base + a] = t0
            if b >= 0:
                event_of(ids[b]).succeed()
            continue
        t0, gid = env._now if lead < 0 else arrival(e, inst, lead, counts), ids[a]
        if kind == SEND:  # b: the destination, g: the bytes (:func:`send`, inline)
            yield e.send(rank, b, g) if plain else send(e, inst, b, g)
        elif (yield from collective(e, inst, a, b, groups[g], tail, t0, gid, dependents)):
            continue  # another member ran it
        starts[gid], ends[gid] = t0, env._now
        if dependents:
            event_of(gid).succeed()
    if own is not None:
        own[name] = DONE


def gating(e: Engine, rank: int, name: str) -> tuple[dict[str, Any] | None, ...]:
    """For chains, the rank's gated streams' gates (``e.gates``: under SMs held beside
    the compute, the compute stream chains only while they are calm), its sharers'
    (``e.sharers``: its collectives over a link they use only while those are calm too),
    and the table holding this stream's own gate, which it sets while it waits."""
    gates = e.gates.get(rank) if e.chains else None
    sharers = e.sharers.get(rank) if e.chains else None
    own = gates if gates is not None and name in gates else \
        sharers if sharers is not None and name in sharers else None
    return gates, sharers, own


def wait_for(e: Engine, inst: Instance, deps: tuple[Any, ...], pending: list[simpy.Event],
             gates: dict[str, Any], name: str) -> Process:
    """A gated stream's wait for a step's pending dependencies, showing meanwhile what of
    its rank's compute it waits for (:func:`simulator.engine.chains.gate`)."""
    gates[name] = gate(e, inst, deps)
    yield joined(e.env, pending)
    gates[name] = None


def collective(e: Engine, inst: Instance, a: int, phases: Any, grp: int, tail: Any,
               t0: float, gid: int, dependents: Any) -> Generator[Event, Any, bool]:
    """One collective step (``a``: its position, ``phases``: the plan's, ``tail``: the
    rendezvous key's): the rendezvous of its members, the lead-in to the latest arrival,
    its flows; True where another member ran it (its spans already written)."""
    burst = burst_of(e, inst.rank) if e.bursts else 0.0
    rv = arrive(e, grp, inst.template.tail(a) if tail is None else tail, t0, gid,
                burst) if e.size[grp] > 1 else None
    if rv is not None and rv.arrived < rv.members:  # another member runs it
        yield rv.done
        waited(e, rv, gid, t0, dependents)
        return True
    wait = lead_in(e, t0, gid, rv)  # until the latest arrival
    if wait > 0:
        yield Timeout(e.env, wait)
    burst = burst if rv is None else rv.burst
    ev = flow(e, gid, phases, grp, rv, burst)
    if ev is None:  # more than one flow, or a burst's extra cost first
        yield from move(e, gid, phases, grp, rv, burst)
    else:
        yield ev
    return False


def arrival(e: Engine, inst: Instance, lead: int, counts: bool) -> float:
    """When the rank arrives at a collective or send: now, or where a run leads into it
    (``lead``, its index), when the run ends."""
    t0 = e.env._now
    if lead >= 0:
        e.run_t0[inst.run_base + lead] = t0
        t0 += inst.totals[lead]
        if counts:
            e._busy[inst.rank] += inst.totals[lead]
    return t0


def burst_of(e: Engine, rank: int) -> float:
    """The rank's compute since its last collective, which this collective takes."""
    burst = e._busy[rank] - e._mark[rank]
    e._mark[rank] = e._busy[rank]
    return burst


def ended(e: Engine, inst: Instance, step: tuple[Any, ...], po: int, ro: int) -> None:
    """A chain's last step's event (the step moved by ``po`` and ``ro``), where someone
    waits for it (:mod:`chains`)."""
    kind, _, a, b, _, _, dependents, _ = step
    if kind == RUN and b >= 0:
        e.event_of(inst.ids[b + po]).succeed()
    elif kind != RUN and dependents:
        e.event_of(inst.ids[a + po]).succeed()


def send(e: Engine, inst: Instance, dst: int, nbytes: float) -> simpy.Event:
    """A point-to-point send to the prototype's peer ``dst`` of the rank: its flow."""
    dst = e.dst(inst, dst)
    ev = e.send(inst.rank, dst, nbytes)
    if e.interference is not None:
        e.interference.slow_while(ev, (inst.rank, dst),
                                  e.interference.send_factor(inst.rank, dst))
    return ev


def arrive(e: Engine, grp: int, tail: Any, t0: float, gid: int,
           burst: float) -> Rendezvous:
    """A member of group ``grp`` registers that it arrives at ``t0``: members register
    when they will arrive; the last to register waits for the latest arrival and runs the
    transfer (its rendezvous leaves the table), the others wait for it to end."""
    key = (grp, tail)
    rv = e.rendezvous.get(key)
    if rv is None:
        rv = e.rendezvous[key] = Rendezvous(e.env, e.size[grp])
    rv.arrived += 1
    if e.bursts:
        rv.burst = max(rv.burst, burst)
    if t0 >= rv.start:
        rv.start, rv.last = t0, gid
    if rv.arrived == rv.members:
        del e.rendezvous[key]
    return rv


def waited(e: Engine, rv: Rendezvous, gid: int, t0: float, dependents: int) -> None:
    """A member that waited for the transfer another ran: its span and event."""
    e.begin[gid] = rv.start
    if rv.last != gid:  # it waited for the latest arrival
        e.last[gid] = rv.last
    e.start[gid] = t0
    e.end[gid] = e.env._now
    if dependents:
        e.event_of(gid).succeed()


def lead_in(e: Engine, t0: float, gid: int, rv: Rendezvous | None) -> float:
    """Seconds until the member that runs a collective (the last to register, or a group
    of one) reaches its start: the latest arrival's (noted as what it waited for)."""
    now = e.env._now
    if rv is None:
        return t0 - now
    if rv.last != gid:
        e.last[gid] = rv.last
    return rv.start - now


def flow(e: Engine, gid: int, phases: Any, grp: int, rv: Rendezvous | None,
         burst: float) -> simpy.Event | None:
    """A collective of one flow, started now: its completion, which is the waiting
    members' event too (no generator, no second event to wake them); None, with nothing
    started, for a plan of more flows or a sync cost that grows with the burst
    (:func:`move`)."""
    if len(phases) != 1 or len(phases[0][0]) != 1:
        return None
    cut = 0.0  # a short burst's discount, off the first phase's latency
    if e.bursts:
        cut = e.burst_cost(phases, burst)
        if cut > 0:
            return None
    e.begin[gid] = e.env._now
    legs, alpha = phases[0]
    link_class, nbytes = legs[0]
    ev = e.net.transfer(nbytes, e.group_links(grp, link_class), e.group_weight(grp),
                        max(alpha + cut, 0.0), None if rv is None else rv.done)
    slow = e.interference
    if slow is not None:
        slow.slow_while(ev, e.members[grp], slow.coll_factor(phases))
    return ev


def move(e: Engine, gid: int, phases: Any, grp: int, rv: Rendezvous | None,
         burst: float) -> Process:
    """The transfer of a collective whose members have all arrived; wakes the members
    that wait (``rv``) when it ends."""
    env = e.env
    e.begin[gid] = env._now
    cut = 0.0  # a short burst's discount, off the first phase's latency
    if e.bursts:
        extra = e.burst_cost(phases, burst)
        if extra > 0:
            yield Timeout(env, extra)
        else:
            cut = extra
    slow = e.interference
    if len(phases) == 1 and len(phases[0][0]) == 1:
        # one flow, whose completion is the members' event: no generator, no second
        # event to wake them
        legs, alpha = phases[0]
        link_class, nbytes = legs[0]
        ev = e.net.transfer(nbytes, e.group_links(grp, link_class), e.group_weight(grp),
                            max(alpha + cut, 0.0), None if rv is None else rv.done)
        if slow is not None:
            slow.slow_while(ev, e.members[grp], slow.coll_factor(phases))
        yield ev
        return
    ev = Event(env)
    if slow is not None:
        slow.slow_while(ev, e.members[grp], slow.coll_factor(phases))
    yield from e.transfer(grp, phases, cut)
    ev.succeed()
    if rv is not None:
        rv.done.succeed()

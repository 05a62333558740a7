"""Chains: consecutive steps of one stream that nothing else observes, run as one event.

A compute run holds its stream for its durations summed in order; a collective of one
simulated member whose single flow crosses only links that no other stream of any
simulated rank ever uses (*private* links: a folded or lock-step rank's NVLink port
under its TP all-reduces; for the compute stream, links that only its rank's gated
streams share with it too, below: it chains only while they are calm, no flow of theirs
running or able to start; and links only its rank's *sharers* share with it, streams
whose collectives hold no SMs, while those are calm as well, :func:`_sharers`) runs alone
on them, at the rate
``min over links of capacity / load`` it gets on empty links, and ends ``α`` after its
bytes have crossed. Nothing outside the stream can see such a step between its start
and its end, so where consecutive steps are of these two kinds, none but the first
waits on another task and none but the last is waited on, the stream computes their
spans in the same floating-point operations, in the same order, that SimPy's clock
and the flow network would (``now + delay`` per timeout, ``remaining / rate`` per
flow, each link's busy seconds added flow by flow) and holds one event until the last
one's end.

The per-step path stays where a chain would not be exact: interference (a run's pace
changes mid-run: a profile's ``gpu.interference`` everywhere; under SMs held by the
collectives of a stream beside the compute, ``Plan.sms``, the compute stream chains only
while each such stream of its rank waits for an event of that compute stream or is done,
:func:`calm`, so none can start before the chain's last step), a sync cost that grows
with the compute burst, a network shared with other jobs (their flows may cross any
link), collectives of several simulated members (a rendezvous), flows of several legs or
phases, sends, and a link's first flow (which registers the link with the network, in
the order the link busy table follows).
``tests/test_chains.py`` compares chained and per-step runs span by span.

Nothing here knows what a transformer is.
"""

from __future__ import annotations

import math
from heapq import heappush
from typing import TYPE_CHECKING, Any

import simpy
from simpy.events import NORMAL, Event

from simulator.engine.compile import COLL, RUN, SEND, Instance
from simulator.system.network import Route

if TYPE_CHECKING:
    from simulator.engine.blocks import Block
    from simulator.engine.engine import Engine


def plan_chains(e: Engine) -> None:
    """Give each instance its collectives a chain may price: id(phases) -> [template
    group, links, alpha, bytes, weight, its link objects and its duration alone once
    its links are registered, whether they are, whether a sharer (:func:`_sharers`)
    uses one of its links]."""
    users: dict[Any, set[tuple[int, int]]] = {}
    e.gates = _gates(e)
    flows = [_flows_of(e, inst) for inst in e.instances]
    for k, of_k in enumerate(flows):
        for s, links in of_k:
            for link in links:
                users.setdefault(link, set()).add((k, s))
    e.sharers = _sharers(e, users, flows)
    for k, inst in enumerate(e.instances):
        chain: dict[int, list[Any]] = {}
        names = inst.template.stream_names
        gated, sharing = e.gates.get(inst.rank, {}), e.sharers.get(inst.rank, {})
        beside = {(k, t) for t, name in enumerate(names) if name in sharing}
        calmed = {(k, t) for t, name in enumerate(names) if name in gated} | beside
        for s, g, phases in inst.template.flows:
            grp = inst.groups[g]
            if len(phases) != 1 or len(phases[0][0]) != 1 or e.size[grp] != 1:
                continue
            legs, alpha = phases[0]
            link_class, nbytes = legs[0]
            links = e.group_links(grp, link_class)
            # the compute stream chains only while its rank's gated streams are calm (no
            # flow of theirs running, none able to start before the chain ends), and over
            # a sharer's link only while the sharers are calm too: links it shares with
            # them alone are its own for such a chain
            mine = {(k, s)} | calmed if names[s] == "compute" else {(k, s)}
            if all(users[link] <= mine for link in links):
                chain[id(phases)] = [g, links, max(alpha + 0.0, 0.0), nbytes,
                                     e.group_weight(grp), None, None, False,
                                     names[s] == "compute"
                                     and any(users[link] & beside for link in links)]
        inst.chain = chain or None


def _sharers(e: Engine, users: dict[Any, set[tuple[int, int]]],
             flows: list[list[tuple[int, Any]]]) -> dict[int, dict[str, Any]]:
    """Per rank, the streams of its own, not gated, that alone share a link with its
    compute stream's flows (a TP stream beside the compute under TE's userbuffers, whose
    collectives hold no SMs): each one's gate (:func:`calm`), at first None. The compute
    stream's collectives over those links chain while they are calm; its runs whatever
    they do. ``flows``: each instance's (:func:`_flows_of`)."""
    out: dict[int, dict[str, Any]] = {}
    for k, inst in enumerate(e.instances):
        names, gated = inst.template.stream_names, e.gates.get(inst.rank, {})
        found: set[str] = set()
        for s, links in flows[k]:
            if names[s] != "compute":
                continue
            for link in links:
                if all(kk == k for kk, _ in users[link]):
                    found |= {names[t] for _, t in users[link]}
        found -= {"compute", *gated}
        if found:
            out[inst.rank] = dict.fromkeys(sorted(found))
    return out


def _gates(e: Engine) -> dict[int, dict[str, Any]]:
    """Per rank whose compute a collective holding SMs may slow mid-run
    (``Engine._sm_slow``: a member of such a group whose collective runs on a stream
    other than compute, on any member), those streams of its own: each one's gate
    (:func:`calm`), at first None. A collective on the compute stream holds its SMs
    while that stream waits for it, so it changes no run's pace."""
    held = e._sm_slow
    if not held:
        return {}
    beside = {inst.groups[g] for inst in e.instances
              for s, g, phases in inst.template.flows
              if id(phases) in held and inst.template.stream_names[s] != "compute"}
    gates: dict[int, dict[str, Any]] = {}
    for inst in e.instances:
        names = inst.template.stream_names
        mine = {names[s] for s, g, phases in inst.template.flows
                if id(phases) in held and inst.groups[g] in beside}
        if mine:
            gates[inst.rank] = dict.fromkeys(sorted(mine - {"compute"}))
    return gates


def gate(e: Engine, inst: Instance, deps: tuple[Any, ...]) -> Event | None:
    """What a gated stream's step waits for that only its rank's compute stream fires: a
    pending event of a task of that stream (None if none). Until it fires, the step's
    collective cannot start, and a chain ends at any step someone waits for."""
    tasks, shared = e.w.tasks, e.w.shared
    for d in deps:
        tid = d if shared is None else e.ids_of[d[0] + inst.delta][d[1]]
        ev = e.events.get(tid)
        if (ev is None or not ev.triggered) and tasks[tid].stream == "compute" \
                and tasks[tid].rank == inst.rank:
            return e.event_of(tid)
    return None


def calm(gates: dict[str, Any]) -> bool:
    """Whether no collective holding SMs can slow the rank's compute before the compute
    stream's next step that someone waits for: each gated stream done (``DONE``) or
    waiting for a compute event (:func:`gate`) that has not fired."""
    return all(g is DONE or (g is not None and not g.triggered) for g in gates.values())


DONE = object()  # a gated stream's gate once it has run its last step


def _flows_of(e: Engine, inst: Instance) -> list[tuple[int, Any]]:
    """(stream index, links) of every flow the instance's program may start."""
    out = []
    for s, g, phases in inst.template.flows:
        grp = inst.groups[g]
        out += [(s, e.group_links(grp, c)) for legs, _ in phases for c, _ in legs]
    for s, dst in inst.template.sends:
        d = e.dst(inst, dst)
        out.append((s, e.topo.send_links(inst.rank, d, e.topo.link_class(inst.rank, d))))
    return out


def _alone(e: Engine, entry: list[Any]) -> bool:
    """Whether the entry's flow can be priced: no flow, or its links registered (its
    duration then computed as the network's ``transfer`` computes a flow alone)."""
    _, links, _, nbytes, weight, _, _, _, _ = entry
    if nbytes <= 0 or not links:
        entry[7] = True
        return True
    got = e.net._resolved.get(id(links))
    if got is None or got[0] is not links:
        return False  # its first flow registers the links
    objs = got[1]
    rate = math.inf
    loads = links.loads if type(links) is Route else None
    for i, link in enumerate(objs):
        load = 0.0 + (loads[i] if loads is not None
                      else weight if link.weighted else 1.0)
        rate = min(rate, link.cap / load)
    entry[5], entry[6], entry[7] = objs, float(nbytes) / rate, True
    return True


def _priced(e: Engine, chain: dict[int, list[Any]], kind: int, phases: Any,
            g: int, shared: bool) -> tuple[float, tuple[Any, ...], float | None, Any] | None:
    """How a chain prices a step of collective ``phases`` over template group ``g``:
    its α, its links' objects, its flow's duration alone (None: no flow) and its one
    link where it has one; None where the step does not chain (``shared``: whether it
    may cross a sharer's link, the sharers being calm)."""
    entry = chain.get(id(phases)) if kind == COLL else None
    if entry is None or entry[0] != g or (entry[8] and not shared) \
            or not (entry[7] or _alone(e, entry)):
        return None
    _, _, alpha, _, _, objs, alone, _, _ = entry
    return alpha, objs, alone, objs[0] if alone is not None and len(objs) == 1 else None


def forward(e: Engine, inst: Instance, steps: list[tuple[Any, ...]],
            offsets: tuple[list[int], list[int]], i: int,
            laid: dict[int, Block] | None = None,
            shared: bool = True) -> tuple[int, Event | None]:
    """Run steps ``i``, ``i + 1``, … of a stream in closed form while they chain: the index
    after the last and the one event at its end if the per-step path would have waited
    (``i`` back, nothing done, where step ``i`` does not chain); ``e.merged`` counts the
    events the per-step path would have scheduled beyond it. Where step ``i`` starts a
    laid copy (``laid``: :class:`simulator.engine.blocks.Block`), its steps are priced
    in one loop (:func:`_block`), the same operations in the same order. ``shared``:
    whether its collectives may cross a link a sharer of the rank uses (the sharers are
    calm, :func:`_sharers`)."""
    t, count, flows, k, n = e.env._now, 0, 0, i, len(steps)
    while k < n:
        blk = laid.get(k) if laid else None
        got = _block(e, inst, blk, offsets, k, t, shared) \
            if blk is not None and (k == i or not steps[k][1]) else None
        if got is not None:
            t, count, flows = got[0], count + got[1], flows + got[2]
            k += len(blk.leads)  # type: ignore[union-attr]
            # its last step waited on (a send after it may not wait), or a send next,
            # or a step that waits on another task: the chain ends
            if steps[k - 1][6] or k == n or steps[k][0] == SEND or steps[k][1]:
                break
            continue
        k, t, count, flows, on = _walk(e, inst, steps, offsets, i, k, t, count, flows, laid,
                                       shared)
        if not on:
            break
    e.net.flows_started += flows
    if k == i or not count:
        return k, None
    e.merged += count - 1
    return k, at(e.env, t)


def _walk(e: Engine, inst: Instance, steps: list[tuple[Any, ...]],
          offsets: tuple[list[int], list[int]], i: int, k: int, t: float, count: int,
          flows: int, laid: dict[int, Block] | None,
          shared: bool) -> tuple[int, float, int, int, bool]:
    """:func:`forward`'s steps one by one from step ``k`` at time ``t`` (the chain began
    at step ``i``): the index after the last, the time at its end, the events and flows
    counted so far and whether the chain goes on at a laid copy (``laid``) reached
    there."""
    k0 = k
    chain: dict[int, list[Any]] = inst.chain or {}
    totals, base, run_t0 = inst.totals, inst.run_base, e.run_t0
    ids, starts, ends, begin = inst.ids, e.start, e.end, e.begin
    n = len(steps)
    po, ro = offsets  # each step's (:class:`simulator.engine.blocks.Blocks`)
    # the last collective's phases, group and pricing (α, links, duration alone, one link)
    phases, group, alpha, alone, link = None, -1, 0.0, None, None
    objs: tuple[Any, ...] = ()
    while k < n:
        if laid and k != k0 and k in laid:
            return k, t, count, flows, True
        kind, deps, a, b, g, _, dependents, lead = steps[k]
        if k > i and deps:
            break
        if kind == RUN:  # a: the run, b: its last task when someone waits for it
            a += ro[k]
            run_t0[base + a] = t
            total = totals[a]
            if total > 0:
                t, count = t + total, count + 1
            k += 1
            if b >= 0:
                break
            continue
        if b is not phases or g != group:
            priced = _priced(e, chain, kind, b, g, shared)
            if priced is None:
                break
            phases, group, (alpha, objs, alone, link) = b, g, priced
        t0 = t  # the arrival, as ``stream`` and ``lead_in`` compute it
        if lead >= 0:
            lead += ro[k]
            run_t0[base + lead] = t
            t0 = t + totals[lead]
            wait = t0 - t
            if wait > 0:
                t, count = t + wait, count + 1
        gid = ids[a + po[k]]
        begin[gid] = t
        if alone is not None:  # the flow: its end, and each link's busy seconds
            t, count, flows = _cross(t, alone, link, objs), count + 1, flows + 1
        if alpha > 0:
            t += alpha
        starts[gid], ends[gid], count = t0, t, count + 1  # the α: one event either way
        k += 1
        if dependents:
            break
    return k, t, count, flows, False


def _block(e: Engine, inst: Instance, blk: Block, offsets: tuple[list[int], list[int]],
           i: int, t: float, shared: bool) -> tuple[float, int, int] | None:
    """The steps of the laid copy whose first step is ``i``, priced from time ``t`` as
    :func:`_walk` prices them (a run's end, the wait for it, the flow alone on its one
    private link, its α), its link's busy seconds added flow by flow: the time at their
    end and the events and flows; None where they do not chain (then nothing is done).
    Their spans are written after the run, from the start and end kept in ``e.priced``
    (:func:`simulator.engine.laid.settle`)."""
    entry = inst.chain.get(id(blk.phases)) if inst.chain else None
    if entry is None or entry[0] != blk.g or (entry[8] and not shared) \
            or not (entry[7] or _alone(e, entry)):
        return None
    _, _, alpha, _, _, objs, alone, _, _ = entry
    if alone is None or len(objs) != 1:
        return None
    link = objs[0]
    p, r = offsets[0][i], offsets[1][i]
    totals, start, busy = inst.totals, t, link.busy
    for lead in blk.leads:
        wait = t + totals[r + lead] - t  # ``t0 - t``
        if wait > 0:  # an event, counted when the spans are written (laid.settle)
            t += wait
        end = t + alone
        busy += end - t
        t = end + alpha  # α >= 0: ``end + 0.0`` is ``end``
    link.busy = busy
    e.priced.append((inst, blk, p, r, start, t, alone, alpha))
    n = len(blk.leads)
    return t, 2 * n, n


def _cross(t: float, alone: float, link: Any, objs: tuple[Any, ...]) -> float:
    """A chained flow's end from ``t`` (``alone`` seconds), each of its links' busy
    seconds added (``now - link.since`` at its end, on every link)."""
    end = t + alone
    busy = end - t
    if link is not None:
        link.busy += busy
    else:
        for one in objs:
            one.busy += busy
    return end


def at(env: simpy.Environment, when: float) -> Event:
    """An event that fires at time ``when`` (absolute: ``now + (when - now)`` need not
    be ``when`` in floating point), as a timeout of normal priority would."""
    ev = Event(env)
    ev._ok, ev._value = True, None
    heappush(env._queue, (when, NORMAL, next(env._eid), ev))
    return ev

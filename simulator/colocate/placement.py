"""Which of the cluster's nodes each job holds.

A job that lists its nodes gets them, in that order; the cluster's ``placement``
policy places the others among the nodes no job lists. A policy is one small function
in :data:`POLICIES`: (free nodes in order, each unplaced job's node count, nodes per
leaf) -> each of those jobs' nodes.

- ``packed``: consecutive free nodes, job after job (a job fills a leaf before the
  next);
- ``spread``: each job over as many leaves as it can, one node per leaf in turn;
- ``interleaved``: the free nodes dealt node by node to the jobs in turn (neighbours
  belong to different jobs).

Every node belongs to at most one job; a file that gives a node twice, names a node the
cluster lacks, or needs more nodes than it has is refused, one line each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from simulator.errors import Problem, UserError
from simulator.spec.cluster_file import ClusterFile

Policy = Callable[[Sequence[int], Sequence[int], int], list[list[int]]]


def packed(free: Sequence[int], sizes: Sequence[int], per_leaf: int) -> list[list[int]]:
    out, k = [], 0
    for n in sizes:
        out.append(list(free[k:k + n]))
        k += n
    return out


def spread(free: Sequence[int], sizes: Sequence[int], per_leaf: int) -> list[list[int]]:
    left = list(free)
    out = []
    for n in sizes:
        leaves: dict[int, list[int]] = {}
        for node in left:
            leaves.setdefault(node // per_leaf, []).append(node)
        mine: list[int] = []
        while len(mine) < n:
            for nodes in leaves.values():
                if nodes and len(mine) < n:
                    mine.append(nodes.pop(0))
        taken = set(mine)
        left = [node for node in left if node not in taken]
        out.append(mine)
    return out


def interleaved(free: Sequence[int], sizes: Sequence[int], per_leaf: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in sizes]
    nodes = iter(free)
    while any(len(mine) < n for mine, n in zip(out, sizes, strict=True)):
        for mine, n in zip(out, sizes, strict=True):
            if len(mine) < n:
                mine.append(next(nodes))
    return out


POLICIES: dict[str, Policy] = {"packed": packed, "spread": spread, "interleaved": interleaved}


def place(spec: ClusterFile, sizes: Sequence[int], names: Sequence[str]) -> list[list[int]]:
    """Each job's nodes (job i needs ``sizes[i]``, its scenario's ``cluster.nodes``)."""
    need = sum(sizes)
    if need > spec.nodes:
        each = ", ".join(f"{name} {n}" for name, n in zip(names, sizes, strict=True))
        raise UserError([Problem("nodes", spec.nodes, f"the jobs need {need} nodes ({each}); "
                                 f"give the cluster at least {need} or shrink a job")])
    placed: dict[int, list[int]] = {}
    holder: dict[int, int] = {}
    for i, job in enumerate(spec.jobs):
        listed = job.node_list()
        if listed is None:
            continue
        _check_listed(spec, i, listed, sizes[i], holder, names)
        placed[i] = listed
        holder.update(dict.fromkeys(listed, i))
    free = [node for node in range(spec.nodes) if node not in holder]
    rest = [i for i in range(len(spec.jobs)) if i not in placed]
    chosen = POLICIES[spec.placement](free, [sizes[i] for i in rest],
                                      spec.fabric.nodes_per_leaf)
    placed.update(zip(rest, chosen, strict=True))
    return [placed[i] for i in range(len(spec.jobs))]


def _check_listed(spec: ClusterFile, i: int, listed: list[int], size: int,
                  holder: dict[int, int], names: Sequence[str]) -> None:
    field = f"jobs[{i}].nodes"
    if len(listed) != size:
        raise UserError([Problem(field, spec.jobs[i].nodes, f"lists {len(listed)} node(s); "
                                 f"job {names[i]!r} runs on {size} (its scenario's "
                                 "cluster.nodes): list that many")])
    seen: set[int] = set()
    for node in listed:
        if node >= spec.nodes:
            raise UserError([Problem(field, node, f"the cluster has nodes 0-{spec.nodes - 1} "
                                     "(nodes); list nodes in that range or raise nodes")])
        if node in seen:
            raise UserError([Problem(field, node, "listed twice; list each node once")])
        seen.add(node)
        if node in holder:
            raise UserError([Problem(field, node, f"also held by job {names[holder[node]]!r} "
                                     f"(jobs[{holder[node]}]); give each node to one job")])

"""ZeRO-3's gathers and reduce-scatters over one shard group share one NCCL
communicator, and NCCL runs the kernels of one communicator in the order they were
launched, whatever CUDA stream each was launched on (NVIDIA/nccl ``src/enqueue.cc``,
v2.18.1-1: every launch acquires the communicator's ``sharedRes->deviceStream``, the
launch stream waits on it and it on the launch, so a communicator's kernels form one
chain). PyTorch's FSDP issues both over its process group (FSDP1:
``_flat_param.py`` ``dist.all_gather_into_tensor(..., group=self.process_group)`` and
``_runtime_utils._reduce_grad`` ``dist.reduce_scatter_tensor(..., group=
state.process_group)``), so a unit's reduce-scatter and the next unit's gather run one
after the other, not side by side as the ``zero`` and ``dp`` streams would let them.

The order is the framework's issue order. In a backward with ``ahead`` units
prefetched, unit j's gather is issued before the reduce-scatters of the ``ahead``
units after it (FSDP1 BACKWARD_PRE issues it in unit j + 1's pre-backward hook, before
j + 1's post-backward reduce-scatter; BACKWARD_POST, Composer's default, in j + 1's
post-backward hook, also before that reduce-scatter): gathers A₀, A₁, … and
reduce-scatters R₀, R₁, … of one backward (in its order, the root's last) run as
A₀ … A_ahead, R₀, A_ahead+1, R₁, …; without prefetch (``ahead`` 0) each gather after
the reduce-scatter before it. The next action's first gather (a forward's, or the next
backward's) is issued after the reduce-scatters of the backward before it.

The workload adds a backward's reduce-scatters after its gathers (the data pass
reduces once the action's gradients are known, after a split backward's weight
gradients) and may insert tasks into the compute stream after the fact (FSDP2's
gradient packs), so the issue order is rebuilt from the compute stream as it ends up:
a reduce-scatter is issued just after the compute task it waits for (the
post-backward hook: the unit's last gradient, or its pack), a forward gather just
after the compute task last in the stream when it was built, and a backward's gather
where the gather ``ahead`` before it in that backward was (the prefetch); on a tie the
reduce-scatter first. Each collective then waits for the one issued before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from simulator.builder.tasks import Task

#: (gather, whether it is a forward's, the compute task last in the stream when it was
#: built, None before any)
Gather = tuple[Task, bool, Task | None]


def issue_order(gathers: Sequence[Gather], reduces: Sequence[Task],
                compute: Sequence[Task], ahead: int) -> list[Task]:
    """The collectives in issue order (see the module notes): positions on the
    ``compute`` stream, a gather's ``ahead`` earlier within its backward (the gathers
    since the last forward one)."""
    index = {task.id: i for i, task in enumerate(compute)}

    def after(task: Task | None) -> float:
        return index[task.id] + 0.5 if task is not None and task.id in index else -0.5

    keyed: list[tuple[float, int, int, Task]] = []
    run: list[float] = []
    for task, forward, anchor in gathers:
        own = float(index[task.id]) if task.id in index else after(anchor)
        run = [] if forward else [*run, own]
        keyed.append((own if forward else run[max(0, len(run) - 1 - ahead)], 1, task.id, task))
    for r in reduces:
        if r.id in index:  # in line on the compute stream
            own = float(index[r.id])
        elif r.deps and r.deps[0] in index:
            own = index[r.deps[0]] + 0.5
        else:
            own = float(len(compute))
        keyed.append((own, 0, r.id, r))
    return [e[3] for e in sorted(keyed, key=lambda e: e[:3])]


def one_communicator(gathers: Sequence[Gather], reduces: Sequence[Task],
                     compute: Sequence[Task], ahead: int) -> None:
    """Impose one communicator's issue order (:func:`issue_order`) on a rank's
    ``gathers`` (in build order) and ``reduces`` over the same group: each waits for
    the one before it on another stream (on its own stream it already does)."""
    order = issue_order(gathers, reduces, compute, ahead)
    for before, task in itertools.pairwise(order):
        if before.stream != task.stream:
            task.deps.append(before.id)

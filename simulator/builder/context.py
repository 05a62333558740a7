"""What every builder pass shares: the task list, the primitives that append to it,
and the hooks through which the pipeline walk calls the strategy passes.

A :class:`Context` holds the programs being built and three primitives: ``add``
(any task), ``compute`` (the hot path, positional) and ``collective`` (a task
carrying its group's :class:`~simulator.system.collectives.plan.Plan`, cached per (op, size,
group), and a ``group_key`` that is equal on every member: the group and the
n-th collective of that group on this rank). Task ids are positions in the one
task list, so the order in which passes append tasks *is* the program; the
order of the hooks below is therefore part of the contract.

A :class:`Pass` is one strategy's contribution. The pipeline pass walks the
schedule and, at fixed points, calls each installed pass's hooks, in the order
the passes are installed (tensor, ZeRO-3 units, data, offload). A pass
overrides only the hooks it needs; only overridden hooks are called, so an
inactive strategy costs nothing on the hot path. A new strategy is a new pass
(and, when it acts somewhere no hook reaches, a new hook here).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from simulator.builder.tasks import Program, Stream, Task
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.mtp import mtp_end_tensors
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import END_TENSORS, zero3_collectives
from simulator.schedules.action import Action, Schedule
from simulator.spec.placement import chunk_layers, embedding_copy_params
from simulator.spec.scenario import OverlapSpec, Scenario
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.plan import GroupShape, Plan
from simulator.system.costs import CostModel
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName

if TYPE_CHECKING:
    from simulator.builder.lazy import Copies
    from simulator.builder.workload import BlockCosts
    from simulator.model.inventory.recompute_comm import Reissue

STREAMS: tuple[Stream, ...] = ("compute", "pp", "dp", "zero", "host")


class Context:
    """The programs under construction and what every pass needs to price tasks."""

    def __init__(self, s: Scenario, layout: Layout, cost: CostModel, costs: BlockCosts,
                 schedule: Schedule, ranks: tuple[int, ...]) -> None:
        self.s, self.layout, self.cost, self.c, self.sched = s, layout, cost, costs, schedule
        self.ranks = ranks
        self.tasks: list[Task] = []
        self.programs = {r: Program(r, {name: [] for name in STREAMS}) for r in ranks}
        self.seq: dict[int, dict[tuple[int, ...], int]] = {r: {} for r in ranks}
        self._placed: dict[int, int] = {}  # rank -> where compute_after last placed a task
        self.plans: dict[tuple[str, float, tuple[int, ...]], Plan] = {}
        self.holds_sms = False  # some collective beside the compute holds SMs (Plan.sms)
        self.last_stage = schedule.total_stages - 1
        self.dt_bytes = dtype_bytes(s.training.dtype)
        self.grad_dt = s.stack.reduce_bytes(self.dt_bytes)  # gradients as they are reduced
        # ZeRO-3 collectives per layer: one, or one per linear module (the stack's unit)
        self.zero3_parts = zero3_collectives(s.model, s.stack)
        # a device that cannot overlap communication with compute runs it all in line
        # and the stack decides whether sends block and gradients reduce after backward
        self.overlap = s.stack.overlap(s.parallel.overlap) if s.hardware.gpu.comm_overlaps_compute \
            else OverlapSpec(dp=False, pp=False, zero3_prefetch=False)
        self.hooks = Hooks.of([])  # the installed passes' hooks (see ``install``)
        # asymmetric folding: the TP index whose ranks stand for the clean ones
        self.clean_tp: int | None = None
        # a mixed-generation cluster: stage -> its system's cost model and block costs
        self.stage_cost: dict[int, CostModel] = {}
        self.stage_c: dict[int, BlockCosts] = {}
        self._last_backward: dict[int, dict[int, int]] = {}  # pp rank -> stage -> index
        self._grad_units: dict[int, list[tuple[float, int]]] = {}  # stage -> grad_units
        # build each (rank, kind, stage)'s actions once and copy them (builder.stamp)
        self.stamp = True
        # a folded build's copies kept as records until read (builder.lazy), or None
        self.lazy: Copies | None = None

    def last_backward(self, pp_rank: int) -> dict[int, int]:
        """Per stage, the index of pipeline rank ``pp_rank``'s last action that computes
        weight gradients (where accumulated gradients are complete)."""
        final = self._last_backward.get(pp_rank)
        if final is None:
            final = {a.stage: i for i, a in enumerate(self.sched.actions[pp_rank])
                     if a.kind in ("B", "W")}
            self._last_backward[pp_rank] = final
        return final

    def c_of(self, rank: int) -> BlockCosts:
        """The block costs on ``rank``'s system."""
        return self.stage_c.get(self.layout.coord(rank).pp, self.c) if self.stage_c \
            else self.c

    def cost_of(self, rank: int) -> CostModel:
        return self.stage_cost.get(self.layout.coord(rank).pp, self.cost) if self.stage_cost \
            else self.cost

    def install(self, passes: list[Pass]) -> None:
        self.hooks = Hooks.of(passes)

    # ------------------------------------------------------------ primitives
    def add(self, rank: int, stream: Stream, **kw: Any) -> Task:
        return self.put(Task(id=len(self.tasks), rank=rank, stream=stream, **kw))

    def put(self, t: Task) -> Task:
        """Append task ``t`` (its id the next) to the tasks and to its rank's stream."""
        self.tasks.append(t)
        self.programs[t.rank].streams[t.stream].append(t)
        return t

    def compute(self, rank: int, op: str, kind: str, name: str, dur: float,
                mb: int, layer: int, chunk: int) -> Task:
        # positional construction: this is the builder's hot path
        t = Task(len(self.tasks), rank, "compute", op, kind, name, dur, None, (), (), -1, 0.0,
                 mb, layer, chunk)
        self.tasks.append(t)
        self.programs[rank].streams["compute"].append(t)
        return t

    def compute_after(self, rank: int, after: Task, op: str, kind: str, name: str,
                      dur: float) -> Task:
        """A compute task that runs on ``after``'s compute stream right after it, however
        many tasks the stream has gained since (a pass that learns of a layer's
        gradients once its whole backward is built puts its per-layer work where it
        runs). The search starts where the rank's last such task went (a backward's
        layers are placed in stream order, so a step's placements cost one pass over
        the stream, not one each), then looks before it."""
        t = Task(len(self.tasks), rank, "compute", op, kind, name, dur, None, (), (), -1, 0.0,
                 after.microbatch, after.layer, after.chunk)
        self.tasks.append(t)
        stream = self.programs[rank].streams["compute"]
        hint = min(self._placed.get(rank, 0), len(stream))
        for i in itertools.chain(range(hint, len(stream)), range(hint - 1, -1, -1)):
            if stream[i] is after:
                stream.insert(i + 1, t)
                self._placed[rank] = i + 2
                return t
        stream.append(t)  # ``after`` is on another stream: next on this one
        return t

    def collective(self, rank: int, stream: Stream, op: CollectiveName, kind: str,
                   group: tuple[int, ...], size: float, name: str, mb: int = -1,
                   layer: int = -1, chunk: int = 0, plan: Plan | None = None) -> Task | None:
        """A collective over ``group``; None (and nothing recorded) for a group of one.
        ``plan``: the collective's own (a library other than NCCL), else NCCL's."""
        if len(group) <= 1 or size <= 0:
            return None
        plan = plan or self.plan_of(op, size, group)
        self.holds_sms = self.holds_sms or (plan.sms > 0 and stream != "compute")
        # the n-th collective of this group *on this rank*: equal on every member
        seq = self.seq[rank]
        n = seq.get(group, 0)
        seq[group] = n + 1
        t = Task(len(self.tasks), rank, stream, f"{kind}.{op}", kind, name, 0.0, plan, group,
                 (group, n), -1, size, mb, layer, chunk)
        self.tasks.append(t)
        self.programs[rank].streams[stream].append(t)
        return t

    def plan_of(self, op: CollectiveName, size: float, group: tuple[int, ...]) -> Plan:
        """NCCL's plan of ``op`` on ``size`` bytes over ``group`` (made once)."""
        plan = self.plans.get((op, size, group))
        if plan is None:
            shape = GroupShape(len(group), len(group) // self.layout.domains_spanned(group))
            plan = make_plan(op, size, shape, self.s.simulation.collective_algorithm,
                             self.s.hardware, self.s.stack.nccl_version)
            self.plans[(op, size, group)] = plan
        return plan

    def count_dependents(self) -> None:
        tasks, lazy = self.tasks, self.lazy
        for t in filter(None, tasks):  # a lazy copy's unmade tasks have no dependencies
            for d in t.deps:
                dep = tasks[d]
                if dep is None:  # an unmade task of a lazy copy: make its copy's
                    assert lazy is not None
                    lazy.fill(lazy.of(d))
                    dep = tasks[d]
                dep.dependents += 1

    # ------------------------------------------------------------ model states
    def layers_of(self, stage: int) -> range:
        """The layers of virtual ``stage`` (:mod:`simulator.spec.placement`; the last one's
        with the multi-token prediction layers)."""
        return chunk_layers(self.s.model.layers, self.s.parallel, stage, self.s.model.mtp_layers)

    def tied_copy_params(self) -> int:
        """Megatron keeps a copy of the word embedding on the last stage, when that stage
        needs it (a tied output layer, multi-token prediction) and its rank is not the
        first's (pp > 1 and no V placement)."""
        return embedding_copy_params(self.s.model, self.s.parallel)

    def grad_bytes(self, stage: int) -> list[float]:
        """Gradient bytes (in the stack's reduction dtype) each 'done' task of a backward
        of ``stage`` completes, in order: one per layer (the head's on the first, as the
        backward runs it first; its own when the stage has no layers), then the
        embedding's on stage 0. A MoE layer's routed experts are not among them: they
        reduce over the expert data-parallel group (:mod:`simulator.strategies.expert.workload`)."""
        spec, tp, dt = self.s.model, self.s.parallel.tp, self.grad_dt
        if spec.is_moe:
            sizes = [(mdl.layer_params(spec, i) - moe.expert_params(spec, i)) / tp * dt
                     for i in reversed(self.layers_of(stage))]
        else:
            sizes = [mdl.layer_params(spec) / tp * dt for _ in self.layers_of(stage)]
        if self.sched.is_last(stage):
            head = (mdl.head_params(spec) + self.tied_copy_params()) / tp * dt
            if sizes:
                sizes[0] += head
            else:
                sizes.append(head)
        if self.sched.is_first(stage):
            sizes.append(mdl.embedding_params(spec) / tp * dt)
        return sizes

    def grad_units(self, stage: int) -> list[tuple[float, int]]:
        """(elements, parameter tensors) of each entry of :meth:`grad_bytes`: a layer's
        tensors (:func:`simulator.model.inventory.layer.layer_tensors`), the head's final norm with
        the
        layer it rides on, the embedding's two tables."""
        got = self._grad_units.get(stage)
        if got is not None:
            return got
        spec, ids = self.s.model, self.layers_of(stage)
        tensors = [layer_tensors(spec, self.s.stack, i)  # in grad_bytes' order
                   for i in (reversed(ids) if spec.is_moe else ids)]
        if self.sched.is_last(stage):  # with the multi-token prediction modules' own
            end = END_TENSORS + mtp_end_tensors(spec)
            if tensors:
                tensors[0] += end
            else:
                tensors.append(end)
        if self.sched.is_first(stage):
            tensors.append(END_TENSORS)
        got = self._grad_units[stage] = [
            (size / self.grad_dt, n)
            for size, n in zip(self.grad_bytes(stage), tensors, strict=True)]
        return got

    def root_params(self, stage: int) -> float:
        """Parameters of virtual ``stage`` outside its transformer layers, per TP rank: the
        embedding on the first stage, the final norm and output layer (and a tied
        embedding's copy) on the last; FSDP2's root unit of the stage's module."""
        spec, par = self.s.model, self.s.parallel
        params = 0.0
        if self.sched.is_first(stage):
            params += mdl.embedding_params(spec)
        if self.sched.is_last(stage):
            params += mdl.head_params(spec) + self.tied_copy_params()
        return params / par.tp

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages (model chunks) that ``rank`` holds."""
        pp = self.layout.coord(rank).pp
        return [st for st in range(self.sched.total_stages) if self.sched.rank_of(st) == pp]

    def params_of(self, rank: int) -> float:
        """Parameters ``rank`` holds (its TP shard of every chunk)."""
        return sum(sum(self.grad_bytes(st)) for st in self.stages_of(rank)) / self.grad_dt

    def optimizer_time(self, rank: int, shard: float) -> float:
        """The optimizer step on ``shard`` parameters of ``rank`` (its stack's kernels)."""
        op = mdl.optimizer_op_of(self.s, shard, [self.layers_of(st)
                                                 for st in self.stages_of(rank)])
        return self.cost_of(rank).op_time(op)


class Pass:
    """One strategy's tasks, added at the hooks of the pipeline walk. Every hook is
    called per simulated rank, in the walk's order:

    per F action, before its first compute: ``forward_start`` (a task that compute
    waits for, or None); per F, B or I action, per layer: ``layer_start`` (a task the layer's first
    compute waits for, or None), then per block (``label`` attn or mlp, forward
    order in F, reverse in B/I, and the recomputed blocks of full recomputation)
    ``block(before=True)``, the block's compute, ``block(before=False)`` (the last
    argument, ``backward``, true in B and I; a pass that splits the block's compute
    into pieces returns the last of them from ``block(before=False)``, which then
    stands for the block); then
    ``layer_end`` with the layer's last compute task. A finer recompute policy's blocks
    (not full recomputation's, which are ``block``'s) call ``recompute_block`` instead,
    before and after the recomputed block's task, with what the policy issues again
    (:func:`simulator.model.inventory.recompute_comm.reissued`). At the model's ends
    ``edge`` ("embed" after the embedding's forward and before its backward,
    "head" before the output layer's forward and after its backward) and after
    the head's forward ``loss``. After each B or W action ``weight_grads`` with
    the tasks that complete each layer's weight gradients (``Context.grad_bytes``
    gives their sizes). After the last action ``sync_end``, the pipeline's own
    end-of-step tasks, ``step`` and ``after_step``.
    """

    #: whether this pass's hooks inside an action (``forward_start`` to ``loss``) are
    #: pure functions of their arguments and of the tasks the action added so far, so
    #: that an action built once may be copied for every micro-batch
    #: (:mod:`simulator.builder.stamp`); a pass that carries state between actions
    #: keeps the default
    stamps = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def forward_start(self, rank: int, stage: int, mb: int, chunk: int) -> Task | None:
        return None

    def layer_start(self, rank: int, forward: bool, mb: int, layer: int,
                    chunk: int) -> Task | None:
        return None

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int, backward: bool) -> Task | None:
        return None

    def recompute_block(self, rank: int, label: str, before: bool, mb: int, layer: int,
                        chunk: int, again: Reissue) -> Task | None:
        return None

    def layer_end(self, rank: int, last: Task) -> None:
        return None

    def edge(self, rank: int, where: str, forward: bool, mb: int, chunk: int) -> None:
        return None

    def loss(self, rank: int, mb: int, chunk: int) -> None:
        return None

    def weight_grads(self, rank: int, index: int, action: Action, done: list[Task],
                     chunk: int) -> None:
        return None

    def bucket_reduced(self, rank: int, size: float, after: Task, chunk: int) -> None:
        """Called by the data pass when a gradient bucket of ``size`` bytes is reduced
        (``after`` is the reduction, or the compute that completed the bucket)."""
        return None

    def sync_end(self, rank: int) -> None:
        return None

    def step(self, rank: int) -> None:
        return None

    def after_step(self, rank: int) -> None:
        return None


def _overriding(passes: list[Pass], name: str) -> list[Any]:
    base = getattr(Pass, name)
    return [getattr(p, name) for p in passes if getattr(type(p), name) is not base]


@dataclass(frozen=True)
class Hooks:
    """Per hook, the bound methods of the installed passes that override it, in order."""

    forward_start: list[Callable[[int, int, int, int], Task | None]]
    layer_start: list[Callable[[int, bool, int, int, int], Task | None]]
    block: list[Callable[[int, str, bool, int, int, int, bool], Task | None]]
    recompute_block: list[Callable[[int, str, bool, int, int, int, Reissue], Task | None]]
    layer_end: list[Callable[[int, Task], None]]
    edge: list[Callable[[int, str, bool, int, int], None]]
    loss: list[Callable[[int, int, int], None]]
    weight_grads: list[Callable[[int, int, Action, list[Task], int], None]]
    bucket_reduced: list[Callable[[int, float, Task, int], None]]
    sync_end: list[Callable[[int], None]]
    step: list[Callable[[int], None]]
    after_step: list[Callable[[int], None]]

    @classmethod
    def of(cls, passes: list[Pass]) -> Hooks:
        return cls(**{f.name: _overriding(passes, f.name) for f in fields(cls)})


def part_label(part: int, parts: int) -> str:
    """A task-name suffix for one of a unit's per-module collectives."""
    return f" part {part + 1}/{parts}" if parts > 1 else ""

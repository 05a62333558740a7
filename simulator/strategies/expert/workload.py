"""Expert pass: a mixture of experts' routed experts, their all-to-alls and gradients.

Per MoE layer and micro-batch (:mod:`simulator.strategies.expert.layer` has the groups, the
sizes and the load), after the MLP block's router, permutation and shared experts
(the pipeline's ``mlp`` block):

- forward: the dispatch all-to-all over the EP group, with expert_tp > 1 an
  all-gather over the expert-TP group, the routed experts' grouped GEMMs (a
  ``forward`` compute task), the reduce-scatter, the combine all-to-all;
- backward, before the MLP block's backward: the mirror (the combine's gradient
  all-to-all, all-gather, the experts' input-gradient GEMMs, reduce-scatter, the
  dispatch's gradient all-to-all). The experts' weight gradients sit in the MLP
  block's weight share (:class:`~simulator.builder.workload.BlockCosts`), so B carries them
  and ZB-H1's W defers them like any weight gradient;
- full recomputation, and Megatron's ``moe`` module (its checkpointed ``MoELayer``
  holds the dispatch and the combine), repeat the forward's exchanges and GEMMs (kind
  ``recompute``; :mod:`simulator.model.inventory.recompute_comm`).

The dispatch and combine collectives are the dispatcher's
(:mod:`simulator.strategies.expert.dispatcher`: all-to-alls, all-gather and
reduce-scatter, or DeepEP's kernels). They (kind ``ep``) and the expert-TP collectives
(kind ``tp``) run on the compute stream: the next kernel needs their tokens. Under
shared-expert overlap (``parallel.moe_shared_expert_overlap``, Megatron-LM's
``--moe-shared-expert-overlap``) the MoE layers' MLP blocks leave out the shared experts'
forward and input gradients, and each ``ep`` exchange runs on an ``ep`` stream from where
compute stands while the shared experts' part beside it computes (forward: first linear
and activation beside the dispatch, second linear beside the combine; backward: the
mirror); a zero-length wait on the compute stream then holds the routed experts (or the
next block) until the exchange is done, so what the exchange adds is max(exchange, shared
part) − shared part. Every rank of a group runs
at the pace of the most loaded one (see the load in
:mod:`simulator.strategies.expert.layer`), so folded and full simulation agree.

Expert gradients reduce over the expert data-parallel group, one collective per
MoE layer when its gradients are complete (after the stage's last backward; after
every backward under ZeRO-2), all-reduce or, under ZeRO-1/2, reduce-scatter, on
the ``dp`` stream (kind ``dp``). The optimizer steps the experts' shard (1/edp
under ZeRO) and ZeRO-1/2 all-gather the updated experts over edp after the step.

Installed for a mixture of experts, before the tensor pass (so a forward MLP
block's tokens come home before its TP reduce-scatter).
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.builder.tasks import Stream, Task
from simulator.model import transformer as mdl
from simulator.model.inventory.recompute_comm import Reissue
from simulator.schedules.action import Action
from simulator.spec.recompute import layer_mode
from simulator.strategies.expert import dispatcher
from simulator.strategies.expert import layer as epar
from simulator.strategies.expert.dispatcher import Exchange, GroupName
from simulator.strategies.zero3.deferred import accumulate_after, deferred
from simulator.system.collectives.plan import GroupShape, Plan
from simulator.system.units import CollectiveName


class ExpertPass(Pass):
    stamps = True  # per MoE layer (``mlp_seen`` restarts at every layer)
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        s, par = ctx.s, ctx.s.parallel
        self.layer = epar.expert_layer(s)
        self.seconds = {p: ctx.cost.ops_time(getattr(self.layer, p))
                        for p in ("fwd", "bwd_input")}
        self.etp, self.ep = par.etp, par.ep
        self.mlp_seen: dict[int, tuple[bool, int]] = {}  # rank -> (forward, mlp blocks so far)
        self.group_of: dict[tuple[int, GroupName], tuple[int, ...]] = {}
        self.plans: dict[tuple[Exchange, GroupShape], Plan | None] = {}
        # under shared-expert overlap: seconds of the shared experts beside each exchange
        self.shared: dict[str, tuple[float | None, float | None]] = {}
        if epar.shared_overlapped(s):
            (f1, f2), (b1, b2) = (epar.shared_ops(s, p) for p in ("fwd", "bwd_input"))
            fwd = (ctx.cost.ops_time(f1), ctx.cost.ops_time(f2))
            self.shared = {"forward": fwd, "recompute": fwd,
                           "backward": (ctx.cost.ops_time(b2), ctx.cost.ops_time(b1))}
            for prog in ctx.programs.values():
                prog.streams.setdefault("ep", [])
        self.reduced: dict[int, list[Task]] = {r: [] for r in ctx.ranks}
        self.reduce: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
        self.deferred = deferred(ctx.s)  # FSDP under torch.distributed.pipelining
        self.backwards: set[tuple[int, int]] = set()  # (rank, stage) that ran a backward
        self.stream: Stream = "dp" if ctx.overlap.dp else "compute"

    # ------------------------------------------------------------ per layer
    def layer_start(self, rank: int, forward: bool, mb: int, layer: int,
                    chunk: int) -> Task | None:
        self.mlp_seen[rank] = (forward, 0)
        return None

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int, backward: bool) -> None:
        if label != "mlp" or not self.ctx.s.model.is_moe_layer(layer):
            return
        forward, seen = self.mlp_seen[rank]
        if before:
            seen += 1
            self.mlp_seen[rank] = (forward, seen)
        # in a backward, full recomputation's forward blocks come first
        recompute = not forward and seen == 1 \
            and layer_mode(self.ctx.s.parallel, self.ctx.s.model.layers, layer) == "full"
        if forward or recompute:
            if not before:
                self.experts(rank, "recompute" if recompute else "forward", mb, layer, chunk)
        elif before:
            self.experts(rank, "backward", mb, layer, chunk)

    def recompute_block(self, rank: int, label: str, before: bool, mb: int, layer: int,
                        chunk: int, again: Reissue) -> None:
        """A MoE block a finer policy re-runs whole (Megatron's ``moe``) dispatches,
        computes its routed experts and combines again, after the block's recomputed
        router, permutation and shared experts, as full recomputation's does."""
        if not before and label == "mlp" and "mlp" in again.blocks \
                and self.ctx.s.model.is_moe_layer(layer):
            self.experts(rank, "recompute", mb, layer, chunk)

    def experts(self, rank: int, kind: str, mb: int, layer: int, chunk: int) -> None:
        """The dispatch, the routed experts, the combine (in a backward their gradients:
        the combine's first); under shared-expert overlap each beside its shared-expert
        part."""
        x, where = self.layer.exchanges, f"L{layer} mb{mb}"
        roles = ("dispatch", "combine") if kind != "backward" else ("combine", "dispatch")
        op, seconds = {"forward": ("F", self.seconds["fwd"]),
                       "recompute": ("R", self.seconds["fwd"]),
                       "backward": ("B", self.seconds["bwd_input"])}[kind]
        shared = self.shared.get(kind, (None, None))
        self.exchange(rank, x.dispatch, roles[0], shared[0], op, kind, mb, layer, chunk)
        self.ctx.compute(rank, op, kind, f"{kind}.experts {where}", seconds, mb, layer, chunk)
        self.exchange(rank, x.combine, roles[1], shared[1], op, kind, mb, layer, chunk)

    def exchange(self, rank: int, xs: tuple[Exchange, ...], role: str, shared: float | None,
                 op: str, kind: str, mb: int, layer: int, chunk: int) -> None:
        """One side's collectives on the compute stream; with ``shared`` seconds of shared
        experts, its ``ep`` exchange on the ``ep`` stream from where compute stands,
        the shared experts computing meanwhile, and compute waiting for it after them."""
        ctx, where = self.ctx, f"L{layer} mb{mb}"
        for x in xs:
            name = f"{x.label.format(role=role)} {where}"
            group = self.group(rank, x.group)
            if shared is None or x.kind != "ep":
                ctx.collective(rank, "compute", x.op, x.kind, group, x.size, name, mb, layer,
                               chunk, self.plan(x, group))
                continue
            compute = ctx.programs[rank].streams["compute"]
            before = compute[-1] if compute else None
            t = ctx.collective(rank, "ep", x.op, x.kind, group, x.size, name, mb, layer,
                               chunk, self.plan(x, group))
            ctx.compute(rank, op, kind, f"{kind}.shared_experts {role} {where}", shared, mb,
                        layer, chunk)
            shared = None
            if t is not None:
                if before is not None:
                    t.deps.append(before.id)
                wait = ctx.compute(rank, op, kind, f"ep.wait {role} {where}", 0.0, mb, layer,
                                   chunk)
                wait.deps.append(t.id)
        if shared is not None:  # no exchange to hide behind
            ctx.compute(rank, op, kind, f"{kind}.shared_experts {role} {where}", shared, mb,
                        layer, chunk)

    def group(self, rank: int, name: GroupName) -> tuple[int, ...]:
        """``rank``'s group ``name`` (built once per rank and name)."""
        found = self.group_of.get((rank, name))
        if found is None:
            found = dispatcher.group(self.ctx.layout, rank, name, self.etp, self.ep)
            self.group_of[(rank, name)] = found
        return found

    def plan(self, x: Exchange, group: tuple[int, ...]) -> Plan | None:
        """The exchange's own plan (DeepEP's), cached per exchange and group shape."""
        if x.deepep is None or len(group) <= 1:
            return None
        shape = GroupShape(len(group), len(group) // self.ctx.layout.domains_spanned(group))
        found = self.plans.get((x, shape))
        if found is None:
            found = x.plan(self.ctx.s, shape)
            self.plans[(x, shape)] = found
        return found

    # ------------------------------------------------------------ gradients
    def weight_grads(self, rank: int, index: int, action: Action, done: list[Task],
                     chunk: int) -> None:
        ctx, par = self.ctx, self.ctx.s.parallel
        group = epar.edp_group(ctx.layout, rank, self.etp, self.ep)
        if len(group) == 1:
            return
        if self.deferred:
            self.accumulate(rank, action, done)
        once = par.zero < 2 or self.deferred
        if once and ctx.last_backward(ctx.layout.coord(rank).pp).get(action.stage) != index:
            return  # gradients accumulate until the stage's last backward
        for layer, task in zip(reversed(ctx.layers_of(action.stage)), done, strict=False):
            size = epar.expert_grad_bytes(ctx.s, layer)
            t = ctx.collective(rank, self.stream, self.reduce, "dp", group, size,
                               f"dp.{self.reduce} experts L{layer}", chunk=chunk) \
                if size else None
            if t is not None:  # under pipelining's REDUCE_GRAD after the whole backward
                t.deps.append((done[-1] if self.deferred else task).id)
                self.reduced[rank].append(t)

    def accumulate(self, rank: int, action: Action, done: list[Task]) -> None:
        """Deferred ZeRO-3 (:mod:`simulator.strategies.zero3.deferred`): each MoE layer's
        expert unit accumulates its unsharded gradients after every backward, a kernel
        on the compute stream after the layer's gradients (a cast on the stage's first
        backward, an add on the later ones)."""
        ctx, key = self.ctx, (rank, action.stage)
        fresh = key not in self.backwards
        self.backwards.add(key)
        for layer, task in zip(reversed(ctx.layers_of(action.stage)), done, strict=False):
            accumulate_after(ctx, rank, task, epar.expert_grad_bytes(ctx.s, layer)
                             / ctx.grad_dt, fresh, action.microbatch, "experts_", f" L{layer}")

    def layers(self, rank: int) -> list[range]:
        """The layer runs ``rank`` holds, one per chunk."""
        ctx = self.ctx
        return [ctx.layers_of(st) for st in ctx.stages_of(rank)]

    def expert_params(self, rank: int) -> float:
        ctx = self.ctx
        return sum(epar.expert_grad_bytes(ctx.s, layer) for run in self.layers(rank)
                   for layer in run) / ctx.grad_dt

    def step(self, rank: int) -> None:
        """The optimizer on the experts' shard, once their gradients are reduced."""
        ctx, par = self.ctx, self.ctx.s.parallel
        shard = self.expert_params(rank) / (par.edp if par.zero >= 1 else 1)
        t = ctx.compute(rank, "optimizer", "optimizer", "optimizer step experts",
                        ctx.cost.op_time(mdl.optimizer_op_of(ctx.s, shard, self.layers(rank),
                                                             "experts")), -1, -1, 0)
        t.deps.extend(r.id for r in self.reduced[rank])

    def after_step(self, rank: int) -> None:
        """ZeRO-1/2: all-gather the updated experts over the expert data-parallel group."""
        ctx, par = self.ctx, self.ctx.s.parallel
        if par.zero not in (1, 2):
            return
        ctx.collective(rank, "compute", "all_gather", "dp",
                       epar.edp_group(ctx.layout, rank, self.etp, self.ep),
                       self.expert_params(rank) * ctx.dt_bytes, "dp.all_gather updated experts")

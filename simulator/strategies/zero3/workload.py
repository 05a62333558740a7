"""ZeRO-3 / FSDP units on the timeline: each unit's parameters all-gathered over the
data-parallel group (its shard group under hybrid sharding) before its forward and
(resharded) again before its backward, prefetched on the ``zero`` stream, the stage's
root unit once per micro-batch, and FSDP2's copies around the gathers.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass, part_label
from simulator.builder.tasks import Stream, Task
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.sharding import (
    ROOT_TENSORS,
    fsdp_gather_parts,
    fsdp_task_name,
    zero3_blocks,
)
from simulator.spec.recompute import layer_mode
from simulator.strategies.expert.layer import edp_group
from simulator.strategies.zero3.communicator import Gather, one_communicator
from simulator.strategies.zero3.deferred import deferred
from simulator.strategies.zero3.experts import (
    dense_unit,
    expert_unit,
    expert_unit_tensors,
    expert_units_sharded,
)


class Zero3Pass(Pass):
    """ZeRO-3 / FSDP units: each layer's parameters all-gathered over DP before its
    forward and, with ``reshard_after_forward``, again before its backward, on the
    ``zero`` stream ``fsdp_prefetch`` units ahead: the gather may start once the unit
    ``fsdp_prefetch + 1`` back has run (on the compute stream, in line, without
    ``overlap.zero3_prefetch``). The stage's root unit (:meth:`Context.root_params`)
    is gathered once per micro-batch before the forward's first compute, after the
    compute issued before it (FSDP2's root pre-forward: the all-gather stream waits
    for the current stream, and the root is not resharded after forward, so its
    backward needs no second gather). Installed when zero = 3 and dp > 1.

    A unit is a layer (FSDP's transformer block), or under a stack whose ZeRO-3 unit is
    the module (DeepSpeed) a block: each linear module is its own all-gather
    (:func:`simulator.model.inventory.sharding.zero3_blocks`, sized by its weight), the attention
    block's (QKV, out-proj) before it and the MLP block's (up, down) before the MLP,
    each gather starting once the block ``fsdp_prefetch + 1`` back has run, and a
    zero-second ``zero3.wait`` holding the block for its own. DeepSpeed fetches a
    submodule's parameters in its pre-forward hook and prefetches the next ones in
    trace order up to ``stage3_prefetch_bucket_size`` (5e7 elements) at a time while
    fewer than ``stage3_max_live_parameters`` (1e9) are gathered
    (runtime/zero/partitioned_param_coordinator.py ``fetch_sub_module``;
    runtime/zero/config.py): about one block ahead at these sizes, not a layer. In a
    backward the blocks need their parameters in the order they run: the recomputed
    forward's (attention, MLP) under full recomputation, else MLP then attention."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        par, spec = ctx.s.parallel, ctx.s.model
        self.unit_done: dict[int, list[Task]] = {r: [] for r in ctx.ranks}
        # elements of each all-gather of one layer, by the block that needs them first
        self.blocks = zero3_blocks(spec, ctx.s.stack, par.tp, mdl.layer_params(spec) / par.tp)
        self.by_block = len(self.blocks) > 1
        # parameter tensors of one gather: the layer's, or one linear module's
        self.tensors = (2 if spec.bias else 1) if self.by_block \
            else layer_tensors(spec, ctx.s.stack)
        count = sum(len(parts) for parts in self.blocks.values())  # the layer's, numbered
        first = {"attn": 0, "mlp": len(self.blocks["attn"])}
        self.labels = {block: [part_label(first[block] + i, count) for i in range(len(parts))]
                       for block, parts in self.blocks.items()}
        self.pending: dict[int, list[str]] = {}  # rank -> blocks of the layer still to gather
        self.forward: dict[int, bool] = {}  # rank -> whether the layer gathering is a forward
        self.stream: Stream = "zero" if ctx.overlap.zero3_prefetch else "compute"
        # a mixture of experts: each layer's dense unit by its own size, then its routed
        # experts' unit over edp (simulator.strategies.zero3.experts)
        self.moe = spec.is_moe
        self.experts = expert_units_sharded(ctx.s)
        self.expert_tensors = expert_unit_tensors(ctx.s)
        # each rank's gathers over its shard group (task, forward), in build order, to
        # run in one communicator's order with the reduce-scatters (zero3.communicator);
        # layer units of a dense model (module units and experts keep their streams)
        self.gathers: dict[int, list[Gather]] = {r: [] for r in ctx.ranks}
        self.serial = not self.by_block and not self.moe
        self.ahead = par.fsdp_prefetch if self.stream == "zero" else 0
        # under torch.distributed.pipelining the units a rank holds gathered, none
        # resharded after a backward (simulator.strategies.zero3.deferred)
        self.held: dict[int, set[object]] | None = \
            {r: set() for r in ctx.ranks} if deferred(ctx.s) else None

    def needs_gather(self, rank: int, unit: object, forward: bool, reshards: bool) -> bool:
        """Whether a pass of ``unit`` gathers it: a forward always, a backward where the
        forward resharded it; where the stage's reductions are deferred
        (:func:`simulator.strategies.zero3.deferred.gathers`) only when not held, a forward
        resharding it after when ``reshards``."""
        if self.held is None:
            return forward or reshards
        held = self.held[rank]
        need = unit not in held
        if forward and reshards:
            held.discard(unit)
        else:
            held.add(unit)
        return need

    def forward_start(self, rank: int, stage: int, mb: int, chunk: int) -> Task | None:
        ctx = self.ctx
        if not self.needs_gather(rank, ("root", stage), True, False):
            return None  # FSDP2 keeps the root gathered after its forward
        size = ctx.root_params(stage) * ctx.dt_bytes
        compute = ctx.programs[rank].streams["compute"]
        before, first = compute[-1] if compute else None, len(ctx.tasks)
        t = self.all_gather(rank, size, ROOT_TENSORS, f"root s{stage} mb{mb}", True, mb, -1,
                            chunk)
        if t is not None and self.stream == "zero" and before is not None:
            ctx.tasks[first].deps.append(before.id)
        return t

    def all_gather(self, rank: int, size: float, tensors: int, label: str, forward: bool,
                   mb: int, layer: int, chunk: int,
                   group: tuple[int, ...] | None = None) -> Task | None:
        """One all-gather of ``size`` bytes (``tensors`` parameter tensors) on the unit's
        stream, with the stack's FSDP kernels around it
        (:func:`simulator.model.inventory.sharding.fsdp_gather_parts`): those before it
        (FSDP2's copy-in, FSDP1's shard cast) on the same stream, those after it (FSDP2's
        copy-out) on the compute stream, which is then what the unit's compute waits for.
        Its first task is the first one added (the caller hangs the prefetch dependency
        on it). Over ``group``, by default the rank's shard group."""
        ctx = self.ctx
        group = group or ctx.layout.shard_group(rank)
        before, after = fsdp_gather_parts(ctx.s.stack, size / ctx.dt_bytes, len(group),
                                          ctx.dt_bytes, tensors) if len(group) > 1 else ((), ())
        kind = "forward" if forward else "backward"
        cost = ctx.cost_of(rank)
        if before:
            ctx.add(rank, self.stream, op="Z", kind=kind,
                    name=f"fsdp.{fsdp_task_name(before)} {label}",
                    duration=cost.ops_time(before), microbatch=mb, layer=layer, chunk=chunk)
        compute = ctx.programs[rank].streams["compute"]
        anchor = compute[-1] if compute else None
        t = ctx.collective(rank, self.stream, "all_gather", "zero", group, size,
                           f"zero3.all_gather {label}", mb, layer, chunk)
        if t is not None and self.serial:
            self.gathers[rank].append((t, forward, anchor))
        if t is None or not after:
            return t
        out = ctx.compute(rank, "Z", kind, f"fsdp.{fsdp_task_name(after)} {label}",
                          cost.ops_time(after), mb, layer, chunk)
        out.deps.append(t.id)
        return out

    def layer_start(self, rank: int, forward: bool, mb: int, layer: int,
                    chunk: int) -> Task | None:
        if not self.needs_gather(rank, layer, forward, self.ctx.s.parallel.reshard_after_forward):
            return None
        if not self.by_block:
            return self.gather(rank, "attn", forward, mb, layer, chunk)
        full = layer_mode(self.ctx.s.parallel, self.ctx.s.model.layers, layer) == "full"
        order = ["attn", "mlp"] if forward or full else ["mlp", "attn"]
        self.pending[rank] = order[1:]
        self.forward[rank] = forward
        return self.gather(rank, order[0], forward, mb, layer, chunk)

    def gather(self, rank: int, block: str, forward: bool, mb: int, layer: int,
               chunk: int) -> Task | None:
        """The all-gathers of one unit, in order on the stream; the last of them."""
        par, ctx = self.ctx.s.parallel, self.ctx
        done = self.unit_done[rank]
        t: Task | None = None
        for i, (elements, label) in enumerate(zip(self.blocks[block], self.labels[block],
                                                  strict=True)):  # one per module, in order
            size = dense_unit(ctx.s, layer) if self.moe else elements  # by the layer's kind
            first = len(ctx.tasks)
            t = self.all_gather(rank, size * ctx.dt_bytes, self.tensors,
                                f"L{layer}{label} mb{mb}", forward, mb, layer, chunk)
            if t is not None and i == 0 and self.stream == "zero" \
                    and len(done) > par.fsdp_prefetch:
                ctx.tasks[first].deps.append(done[-(par.fsdp_prefetch + 1)].id)
        if self.experts and expert_unit(ctx.s, layer):
            t = self.expert_gather(rank, forward, mb, layer, chunk) or t
        return t

    def expert_gather(self, rank: int, forward: bool, mb: int, layer: int,
                      chunk: int) -> Task | None:
        """The MoE ``layer``'s routed-experts unit gathered over the expert data-parallel
        group, right after the layer's own unit on the same stream (torchtitan prefetches
        ``[next_transformer_block, next_transformer_block.moe.experts]`` together)."""
        ctx, par = self.ctx, self.ctx.s.parallel
        group = edp_group(ctx.layout, rank, par.etp, par.ep)
        return self.all_gather(rank, expert_unit(ctx.s, layer) * ctx.dt_bytes,
                               self.expert_tensors, f"L{layer} experts mb{mb}", forward, mb,
                               layer, chunk, group)

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int, backward: bool) -> Task | None:
        if not self.by_block:
            return None
        ctx = self.ctx
        if not before:  # the block (and what followed it in line) has run
            self.unit_done[rank].append(ctx.programs[rank].streams["compute"][-1])
            return None
        pending = self.pending.get(rank)
        if pending and pending[0] == label:
            pending.pop(0)
            t = self.gather(rank, label, self.forward.get(rank, True), mb, layer, chunk)
            if t is not None and self.stream == "zero":
                w = ctx.compute(rank, "Z", "backward" if backward else "forward",
                                f"zero3.wait L{layer} {label} mb{mb}", 0.0, mb, layer, chunk)
                w.deps.append(t.id)
        return None

    def layer_end(self, rank: int, last: Task) -> None:
        if not self.by_block:
            self.unit_done[rank].append(last)

    def step(self, rank: int) -> None:
        """The rank's gathers and reduce-scatters over its shard group in one
        communicator's order (:func:`simulator.strategies.zero3.communicator.
        one_communicator`), once both are built."""
        if not self.serial:
            return
        group = self.ctx.layout.shard_group(rank)
        reduces = [t for ts in self.ctx.programs[rank].streams.values() for t in ts
                   if t.op == "dp.reduce_scatter" and t.group == group]
        one_communicator(self.gathers.pop(rank, []), reduces,
                         self.ctx.programs[rank].streams["compute"], self.ahead)

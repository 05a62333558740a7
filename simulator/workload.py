"""Workload: per-rank programs of tasks, built from a scenario and a layout.

A program is, per simulated rank, an ordered list of :class:`Task` per stream
(``compute``, ``pp``, ``dp``). A task is compute (a fixed duration priced by the
cost model), a collective over a group (a :class:`~simulator.collectives.Plan`),
or a point-to-point transfer. Cross-stream and cross-rank dependencies are task
ids. Everything here is plain data: the engine runs it, tests inspect it.

What goes where (Megatron-LM's execution):

- Pipeline actions come from :mod:`simulator.schedules`; each F/B/I/W of a
  virtual stage expands to per-layer blocks (attention, MLP) with the TP
  collectives between them on the compute stream — two in forward, two in
  backward per layer (all-reduce, or all-gather + reduce-scatter with sequence
  parallelism), plus the vocab-parallel ends: the embedding's all-reduce, the
  output layer's input-gradient all-reduce and the cross-entropy's three small
  all-reduces. With tp = 1 a layer is one block.
- Pipeline activations and gradients (b·s·h bytes per TP rank, b·s·h/t with
  sequence parallelism, as Megatron-core's p2p shapes) go out on the ``pp``
  stream as soon as they are produced; the receiver's next compute waits for the
  transfer. ``overlap.pp: false`` puts the
  send on the compute stream.
- DP gradients are bucketed (``dp_bucket_MB``) in the order the last
  micro-batch's backward produces them, each bucket reduced on the ``dp``
  stream; the optimizer step waits for all of them. ZeRO-2 and ZeRO-3 keep only
  a gradient shard, so they reduce-scatter after *every* micro-batch's backward
  (DeepSpeed's and FSDP's behaviour under gradient accumulation: m × the
  traffic of one reduction). ``overlap.dp: false`` runs
  them on the compute stream after the backward. ZeRO-1/2 reduce-scatter the
  buckets (ZeRO-1 may all-reduce; Megatron's distributed optimizer scatters) and
  all-gather the updated parameters after the step.
- ZeRO-3 / FSDP: each layer is a unit whose parameters are all-gathered over DP
  before its forward and, with ``reshard_after_forward``, again before its
  backward, on the ``zero`` stream ``fsdp_prefetch`` units ahead (on the compute
  stream without ``overlap.zero3_prefetch``); each unit's gradients are
  reduce-scattered as the last micro-batch's backward produces them. The
  embedding and head stay replicated (small next to the layers).
- ZeRO-Offload (Ren et al. 2021): each gradient bucket's shard is copied to the
  host over PCIe (``host`` stream) as soon as it is reduced, overlapping the rest
  of the backward; CPU Adam then updates the shard (``cpu_adam_params_per_s``),
  the updated 16-bit shard returns over PCIe and DP all-gathers it. The GPU runs
  no optimizer step.
- A profile whose device cannot overlap communication with compute
  (``gpu.comm_overlaps_compute: false``, a CPU process) runs every transfer on the
  compute stream, whatever ``parallel.overlap`` asks.
- Symmetry folding builds programs for one representative per stage; its
  collectives carry their full group's plan and its flows stand for every rank
  of its class on shared links (``Program.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simulator import model as mdl
from simulator.collectives import GroupShape, Plan, make_plan
from simulator.costs import CostModel
from simulator.hardware import CollectiveName
from simulator.layout import Layout
from simulator.scenario import OverlapSpec, Scenario
from simulator.schedules import Action, Schedule, build_schedule
from simulator.tasks import Program, Stream, Task, Workload, gc_paused

OPTIMIZER_BYTES_PER_PARAM = 28.0  # AdamW: read fp32 w, m, v, grad(bf16); write w, m, v, bf16 copy


@dataclass(frozen=True)
class BlockCosts:
    """Seconds for one layer's blocks on one TP rank, per micro-batch."""

    fwd: tuple[float, float]  # (attention block, MLP block)
    bwd_input: tuple[float, float]
    bwd_weight: tuple[float, float]
    recompute: tuple[float, float]
    embed: tuple[float, float, float]  # fwd, bwd_input, bwd_weight
    head: tuple[float, float, float]


def _split(ops: tuple[mdl.Op, ...], cost: CostModel, forward_order: bool) -> tuple[float, float]:
    names = [op.name for op in ops]
    cut = names.index("ln2") if forward_order else names.index("ln2") + 1
    first, second = cost.ops_time(ops[:cut]), cost.ops_time(ops[cut:])
    return (first, second) if forward_order else (second, first)


def block_costs(s: Scenario, cost: CostModel) -> BlockCosts:
    spec, b, tp, sp, dt = (s.model, s.training.micro_batch, s.parallel.tp,
                           s.parallel.sequence_parallel, s.training.dtype)
    fwd = mdl.layer_ops(spec, b, tp, sp, dt, "fwd")
    bwd_i = mdl.layer_ops(spec, b, tp, sp, dt, "bwd_input")
    bwd_w = mdl.layer_ops(spec, b, tp, sp, dt, "bwd_weight")
    w_names = [op.name for op in bwd_w]
    w_attn = cost.ops_time([op for op in bwd_w if op.name in ("qkv", "out_proj")])
    w_mlp = cost.ops_time([op for op in bwd_w if op.name not in ("qkv", "out_proj")])
    assert "qkv" in w_names
    rec = mdl.layer_recompute_ops(spec, b, tp, sp, dt, s.parallel.recompute)
    full = s.parallel.recompute == "full"
    rec_t = _split(rec, cost, True) if full else (cost.ops_time(rec), 0.0)

    def three(fn: Any) -> tuple[float, float, float]:
        return tuple(cost.ops_time(fn(spec, b, tp, sp, dt, p)) for p in mdl.PASSES)  # type: ignore[return-value]

    return BlockCosts(_split(fwd, cost, True), _split(bwd_i, cost, False), (w_attn, w_mlp),
                      rec_t, three(mdl.embedding_ops), three(mdl.head_ops))


class _Builder:
    def __init__(self, s: Scenario, layout: Layout, cost: CostModel, costs: BlockCosts,
                 schedule: Schedule, ranks: tuple[int, ...]) -> None:
        self.s, self.layout, self.cost, self.c, self.sched = s, layout, cost, costs, schedule
        self.ranks = ranks
        self.tasks: list[Task] = []
        self.programs = {r: Program(r, {"compute": [], "pp": [], "dp": [], "zero": [],
                                         "host": []})
                         for r in ranks}
        self.unit_done: dict[int, list[Task]] = {r: [] for r in ranks}
        self.seq: dict[int, dict[tuple[int, ...], int]] = {r: {} for r in ranks}
        self.plans: dict[tuple[str, float, tuple[int, ...]], Plan] = {}
        self.sends: dict[tuple[str, int, int, int], int] = {}  # (dir, stage, mb, rank) -> task
        self.waits: list[tuple[Task, tuple[str, int, int, int]]] = []
        spec = s.model
        self.layers_per_chunk = spec.layers // (s.parallel.pp * s.parallel.virtual_stages)
        self.dt_bytes = mdl.dtype_bytes(s.training.dtype)
        self.act_bytes = mdl.pp_activation_bytes(spec, s.training.micro_batch, s.training.dtype)
        if s.parallel.sequence_parallel:  # the boundary tensor is [s/t, b, h] per TP rank
            self.act_bytes /= s.parallel.tp
        self.tp_bytes = mdl.tp_comm_bytes_per_layer(spec, s.training.micro_batch, s.training.dtype)
        self.algorithm = s.simulation.collective_algorithm
        self.pcie = s.hardware.host.pcie_bandwidth_GBps * 1e9
        # a device that cannot overlap communication with compute runs it all in line
        self.overlap = s.parallel.overlap if s.hardware.gpu.comm_overlaps_compute \
            else OverlapSpec(dp=False, pp=False, zero3_prefetch=False)

    # ------------------------------------------------------------ primitives
    def add(self, rank: int, stream: Stream, **kw: Any) -> Task:
        t = Task(id=len(self.tasks), rank=rank, stream=stream, **kw)
        self.tasks.append(t)
        self.programs[rank].streams[stream].append(t)
        return t

    def compute(self, rank: int, op: str, kind: str, name: str, dur: float,
                mb: int, layer: int, chunk: int) -> Task:
        # positional construction: this is the builder's hot path
        t = Task(len(self.tasks), rank, "compute", op, kind, name, dur, None, (), (), -1, 0.0,
                 mb, layer, chunk)
        self.tasks.append(t)
        self.programs[rank].streams["compute"].append(t)
        return t

    def collective(self, rank: int, stream: Stream, op: CollectiveName, kind: str,
                   group: tuple[int, ...], size: float, name: str, mb: int = -1,
                   layer: int = -1, chunk: int = 0) -> Task | None:
        if len(group) <= 1 or size <= 0:
            return None
        plan = self.plans.get((op, size, group))
        if plan is None:
            shape = GroupShape(len(group), len(group) // self.layout.nodes_spanned(group))
            plan = make_plan(op, size, shape, self.algorithm, self.s.hardware)
            self.plans[(op, size, group)] = plan
        # the n-th collective of this group *on this rank*: equal on every member
        seq = self.seq[rank]
        n = seq.get(group, 0)
        seq[group] = n + 1
        t = Task(len(self.tasks), rank, stream, f"{kind}.{op}", kind, name, 0.0, plan, group,
                 (group, n), -1, size, mb, layer, chunk)
        self.tasks.append(t)
        self.programs[rank].streams[stream].append(t)
        return t

    def tp_around(self, rank: int, before: bool, mb: int, layer: int, chunk: int) -> None:
        """TP collective around a block: all-reduce after it, or with sequence
        parallelism all-gather before and reduce-scatter after (both directions)."""
        sp = self.s.parallel.sequence_parallel
        if before and not sp:
            return
        op: CollectiveName = ("all_gather" if before else "reduce_scatter") if sp else "all_reduce"
        self.collective(rank, "compute", op, "tp", self.layout.tp_group(rank), self.tp_bytes,
                        f"tp.{op} L{layer} mb{mb}", mb, layer, chunk)

    def gather_unit(self, rank: int, mb: int, layer: int, chunk: int) -> Task | None:
        """ZeRO-3: all-gather one layer's parameters before it runs. With prefetch depth
        k on its own stream, the gather may start once the unit k + 1 back is done."""
        par = self.s.parallel
        size = mdl.layer_params(self.s.model) / par.tp * self.dt_bytes
        stream: Stream = "zero" if self.overlap.zero3_prefetch else "compute"
        t = self.collective(rank, stream, "all_gather", "zero", self.layout.dp_group(rank), size,
                            f"zero3.all_gather L{layer} mb{mb}", mb, layer, chunk)
        done = self.unit_done[rank]
        if t is not None and stream == "zero" and len(done) > par.fsdp_prefetch:
            t.deps.append(done[-(par.fsdp_prefetch + 1)].id)
        return t

    def unit(self, rank: int, forward: bool, mb: int, layer: int, chunk: int) -> Task | None:
        """Gather before a layer's forward, and before its backward when resharded."""
        par = self.s.parallel
        if par.zero != 3 or par.dp == 1 or (not forward and not par.reshard_after_forward):
            return None
        return self.gather_unit(rank, mb, layer, chunk)

    def tp_edge(self, rank: int, where: str, forward: bool, mb: int, chunk: int) -> None:
        """Megatron's vocab-parallel ends. The embedding's partial sums are all-reduced
        (reduce-scattered with SP) after its forward; the output layer takes a
        replicated input (all-gathered with SP) and all-reduces (reduce-scatters) its
        input gradient in backward. With SP the embedding's backward all-gathers."""
        sp = self.s.parallel.sequence_parallel
        if where == "embed":
            op: CollectiveName | None = ("reduce_scatter" if sp else "all_reduce") if forward \
                else ("all_gather" if sp else None)
        else:
            op = ("all_gather" if sp else None) if forward \
                else ("reduce_scatter" if sp else "all_reduce")
        if op is not None:
            self.collective(rank, "compute", op, "tp", self.layout.tp_group(rank),
                            self.tp_bytes, f"tp.{op} {where} mb{mb}", mb, -1, chunk)

    def tp_loss(self, rank: int, mb: int, chunk: int) -> None:
        """Vocab-parallel cross-entropy: three all-reduces of one fp32 per token (the
        logits' max, the target logit, the sum of exponentials)."""
        tokens = self.s.training.micro_batch * self.s.model.seq_len
        for what in ("max", "target", "sum"):
            self.collective(rank, "compute", "all_reduce", "tp", self.layout.tp_group(rank),
                            4.0 * tokens, f"tp.all_reduce loss {what} mb{mb}", mb, -1, chunk)

    def wait_for(self, task: Task, key: tuple[str, int, int, int]) -> None:
        self.waits.append((task, key))

    # ------------------------------------------------------------ actions
    def layers_of(self, stage: int) -> range:
        first = stage * self.layers_per_chunk
        return range(first, first + self.layers_per_chunk)

    def forward(self, rank: int, a: Action, chunk: int) -> Task:
        c, mb, last = self.c, a.microbatch, self.sched.stages * self.sched.virtual_stages - 1
        head: Task | None = None
        if a.stage == 0:
            head = self.compute(rank, "F", "forward", f"embed mb{mb}", c.embed[0], mb, -1, chunk)
            self.tp_edge(rank, "embed", True, mb, chunk)
        for layer in self.layers_of(a.stage):
            gather = self.unit(rank, True, mb, layer, chunk)
            for blk, label in ((0, "attn"), (1, "mlp")):
                self.tp_around(rank, True, mb, layer, chunk)
                t = self.compute(rank, "F", "forward", f"fwd.{label} L{layer} mb{mb}",
                                 c.fwd[blk], mb, layer, chunk)
                if gather is not None and blk == 0 and gather.stream != "compute":
                    t.deps.append(gather.id)
                head = head or t
                self.tp_around(rank, False, mb, layer, chunk)
            self.unit_done[rank].append(t)
        if a.stage == last:
            self.tp_edge(rank, "head", True, mb, chunk)
            self.compute(rank, "F", "forward", f"head mb{mb}", c.head[0], mb, -1, chunk)
            self.tp_loss(rank, mb, chunk)
        assert head is not None
        if a.stage > 0:
            self.wait_for(head, ("act", a.stage - 1, mb, rank))
        return head

    def backward(self, rank: int, a: Action, chunk: int, weights: bool) -> list[Task]:
        """B (``weights``) or I: head, layers in reverse, embedding; returns the tasks
        that finish each layer's weight gradients (for DP buckets)."""
        c, mb, last = self.c, a.microbatch, self.sched.stages * self.sched.virtual_stages - 1
        w = 1.0 if weights else 0.0
        op, kind = ("B", "backward") if weights else ("I", "backward")
        first: Task | None = None
        done: list[Task] = []
        if a.stage == last:
            first = self.compute(rank, op, kind, f"head.bwd mb{mb}",
                                 c.head[1] + w * c.head[2], mb, -1, chunk)
            first.weight_s = w * c.head[2]
            self.tp_edge(rank, "head", False, mb, chunk)
        for layer in reversed(self.layers_of(a.stage)):
            gather = self.unit(rank, False, mb, layer, chunk)
            if self.s.parallel.recompute != "none":
                t = self.recompute(rank, mb, layer, chunk)
                first = first or t
                if gather is not None and gather.stream != "compute":
                    t.deps.append(gather.id)
                    gather = None
            for blk, label in ((1, "mlp"), (0, "attn")):
                self.tp_around(rank, True, mb, layer, chunk)
                t = self.compute(rank, op, kind, f"bwd.{label} L{layer} mb{mb}",
                                 c.bwd_input[blk] + w * c.bwd_weight[blk], mb, layer, chunk)
                t.weight_s = w * c.bwd_weight[blk]
                if gather is not None and blk == 1 and gather.stream != "compute":
                    t.deps.append(gather.id)
                first = first or t
                self.tp_around(rank, False, mb, layer, chunk)
            done.append(t)
            self.unit_done[rank].append(t)
        if a.stage == 0:
            self.tp_edge(rank, "embed", False, mb, chunk)
            t = self.compute(rank, op, kind, f"embed.bwd mb{mb}", w * c.embed[2], mb, -1, chunk)
            t.weight_s = w * c.embed[2]
            first = first or t
            done.append(t)
        assert first is not None
        if a.stage < last:
            self.wait_for(first, ("grad", a.stage + 1, mb, rank))
        return done

    def recompute(self, rank: int, mb: int, layer: int, chunk: int) -> Task:
        c = self.c
        if self.s.parallel.recompute == "selective":
            return self.compute(rank, "R", "recompute", f"recompute.attn L{layer} mb{mb}",
                                c.recompute[0], mb, layer, chunk)
        first = None
        for blk, label in ((0, "attn"), (1, "mlp")):
            self.tp_around(rank, True, mb, layer, chunk)
            t = self.compute(rank, "R", "recompute", f"recompute.{label} L{layer} mb{mb}",
                             c.recompute[blk], mb, layer, chunk)
            first = first or t
            self.tp_around(rank, False, mb, layer, chunk)
        assert first is not None
        return first

    def weight_grad(self, rank: int, a: Action, chunk: int) -> list[Task]:
        c, mb, last = self.c, a.microbatch, self.sched.stages * self.sched.virtual_stages - 1
        done = []
        if a.stage == last:
            self.compute(rank, "W", "weight_grad", f"head.wgrad mb{mb}", c.head[2], mb, -1, chunk)
        for layer in reversed(self.layers_of(a.stage)):
            done.append(self.compute(rank, "W", "weight_grad", f"wgrad L{layer} mb{mb}",
                                     sum(c.bwd_weight), mb, layer, chunk))
        if a.stage == 0:
            done.append(self.compute(rank, "W", "weight_grad", f"embed.wgrad mb{mb}",
                                     c.embed[2], mb, -1, chunk))
        return done

    def send(self, rank: int, direction: str, stage: int, mb: int, after: Task,
             to_stage: int, chunk: int) -> None:
        coord = self.layout.coord(rank)
        dst = self.layout.rank(self.sched.rank_of(to_stage), coord.dp, coord.tp)
        stream: Stream = "pp" if self.overlap.pp else "compute"
        t = self.add(rank, stream, op="pp.send", kind="pp",
                     name=f"pp.send {direction} s{stage}->s{to_stage} mb{mb}", dst=dst,
                     nbytes=self.act_bytes, microbatch=mb, chunk=chunk)
        t.deps.append(after.id)
        self.sends[(direction, stage, mb, dst)] = t.id

    # ------------------------------------------------------------ data parallel
    def grad_bytes(self, stage: int) -> list[float]:
        """Gradient bytes each 'done' task of a backward completes, in order."""
        spec, tp, dt = self.s.model, self.s.parallel.tp, self.dt_bytes
        last = self.sched.stages * self.sched.virtual_stages - 1
        sizes = [mdl.layer_params(spec) / tp * dt for _ in self.layers_of(stage)]
        if stage == last:
            sizes[0] += (mdl.head_params(spec) + self.tied_copy_params()) / tp * dt
        if stage == 0:
            sizes.append(mdl.embedding_params(spec) / tp * dt)
        return sizes

    def tied_copy_params(self) -> int:
        """Megatron keeps a copy of a tied word embedding on the last stage when pp > 1."""
        spec = self.s.model
        return spec.vocab * spec.hidden if spec.tied_embeddings and self.s.parallel.pp > 1 else 0

    def embedding_group_sync(self, rank: int) -> None:
        """All-reduce the tied embedding's gradient between the first and last stage."""
        coord, par = self.layout.coord(rank), self.s.parallel
        if not self.tied_copy_params() or coord.pp not in (0, par.pp - 1):
            return
        group = (self.layout.rank(0, coord.dp, coord.tp),
                 self.layout.rank(par.pp - 1, coord.dp, coord.tp))
        size = self.tied_copy_params() / par.tp * self.dt_bytes
        self.collective(rank, "compute", "all_reduce", "embedding_tie", group, size,
                        "embedding_tie.all_reduce tied embedding grads")

    def dp_sync(self, rank: int, stage: int, done: list[Task], chunk: int,
                pending: list[tuple[float, Task]]) -> None:
        """Bucket the gradients the last micro-batch's backward completes."""
        for size, task in zip(self.grad_bytes(stage), done, strict=True):
            pending.append((size, task))
            per_unit = self.s.parallel.zero == 3  # FSDP reduce-scatters each unit's gradients
            if per_unit or sum(sz for sz, _ in pending) >= self.s.parallel.dp_bucket_MB * 1e6:
                self.flush_bucket(rank, pending, chunk)

    def flush_bucket(self, rank: int, pending: list[tuple[float, Task]], chunk: int) -> None:
        if not pending:
            return
        size, after = sum(sz for sz, _ in pending), pending[-1][1]
        pending.clear()
        op: CollectiveName = "all_reduce" if self.s.parallel.zero == 0 else "reduce_scatter"
        stream: Stream = "dp" if self.overlap.dp else "compute"
        t = self.collective(rank, stream, op, "dp", self.layout.dp_group(rank), size,
                            f"dp.{op} bucket {size / 1e6:.1f} MB", chunk=chunk)
        if t is not None:
            t.deps.append(after.id)
        if self.s.parallel.zero_offload:  # the rank's gradient shard goes to host memory
            shard = size / self.s.parallel.dp if self.s.parallel.zero >= 1 else size
            d2h = self.add(rank, "host", op="offload.d2h", kind="offload",
                           name=f"offload.d2h grads {shard / 1e6:.1f} MB",
                           duration=shard / self.pcie, nbytes=shard, chunk=chunk)
            d2h.deps.append((t or after).id)

    def gather_after_step(self, rank: int, params: float, stages: list[int]) -> Task | None:
        """ZeRO-1/2: all-gather the updated parameters. ZeRO-3: only the embedding and
        head, which this model keeps replicated; the layers are gathered at use."""
        par, spec = self.s.parallel, self.s.model
        if par.zero in (1, 2):
            nbytes = params * self.dt_bytes
        elif par.zero == 3:
            layers = sum(len(self.layers_of(st)) for st in stages)
            nbytes = params * self.dt_bytes - layers * mdl.layer_params(spec) / par.tp \
                * self.dt_bytes
        else:
            return None
        return self.collective(rank, "compute", "all_gather", "dp", self.layout.dp_group(rank),
                               nbytes, "dp.all_gather updated params")

    def offloaded_step(self, rank: int, params: float, stages: list[int]) -> None:
        """ZeRO-Offload: CPU Adam on the rank's shard once all its gradients are on the
        host, then the updated 16-bit shard back over PCIe and the DP all-gather."""
        par, hw = self.s.parallel, self.s.hardware
        shard = params / par.dp
        self.add(rank, "host", op="optimizer", kind="optimizer", name="cpu adam step",
                 duration=shard * self.layout.gpus_per_node / hw.host.cpu_adam_params_per_s)
        h2d = self.add(rank, "host", op="offload.h2d", kind="offload",
                       name="offload.h2d params", duration=shard * self.dt_bytes / self.pcie,
                       nbytes=shard * self.dt_bytes)
        # the step ends when the new parameters are back on the GPU (and gathered)
        wait = self.compute(rank, "optimizer", "optimizer", "wait for host step",
                            0.0, -1, -1, 0)
        wait.deps.append(h2d.id)
        self.gather_after_step(rank, params, stages)

    def optimizer(self, rank: int) -> None:
        par = self.s.parallel
        stages = [st for st in range(self.sched.stages * self.sched.virtual_stages)
                  if self.sched.rank_of(st) == self.layout.coord(rank).pp]
        params = sum(sum(self.grad_bytes(st)) for st in stages) / self.dt_bytes
        self.embedding_group_sync(rank)
        if par.zero_offload:
            self.offloaded_step(rank, params, stages)
            return
        shard = params / par.dp if par.zero >= 1 else params
        step = self.compute(rank, "optimizer", "optimizer", "optimizer step",
                            self.cost.memory_time(shard * OPTIMIZER_BYTES_PER_PARAM), -1, -1, 0)
        step.deps.extend(t.id for t in self.programs[rank].streams["dp"])
        step.deps.extend(t.id for t in self.programs[rank].streams["zero"][-1:])
        self.gather_after_step(rank, params, stages)

    # ------------------------------------------------------------ driver
    def build_rank(self, rank: int) -> None:
        pp_rank = self.layout.coord(rank).pp
        last = self.sched.stages * self.sched.virtual_stages - 1
        actions = self.sched.actions[pp_rank]
        final = {}
        for i, a in enumerate(actions):
            if a.kind in ("B", "W"):
                final[a.stage] = i
        pending: list[tuple[float, Task]] = []
        for i, a in enumerate(actions):
            chunk = self.sched.chunk_of(a.stage)
            compute = self.programs[rank].streams["compute"]
            if a.kind == "F":
                self.forward(rank, a, chunk)
                if a.stage < last:
                    self.send(rank, "act", a.stage, a.microbatch, compute[-1], a.stage + 1, chunk)
                continue
            if a.kind in ("B", "I"):
                done = self.backward(rank, a, chunk, weights=a.kind == "B")
                if a.stage > 0:
                    self.send(rank, "grad", a.stage, a.microbatch, compute[-1], a.stage - 1,
                              chunk)
            else:
                done = self.weight_grad(rank, a, chunk)
            par = self.s.parallel
            if (par.dp == 1 and not par.zero_offload) or a.kind == "I":
                continue
            if par.zero >= 2:  # sharded gradients: reduce after every micro-batch
                self.dp_sync(rank, a.stage, done, chunk, pending)
                self.flush_bucket(rank, pending, chunk)
            elif final.get(a.stage) == i:  # accumulate locally, reduce once
                self.dp_sync(rank, a.stage, done, chunk, pending)
        if pending:
            self.flush_bucket(rank, pending, 0)
        self.optimizer(rank)

    def resolve(self) -> None:
        for task, key in self.waits:
            sid = self.sends.get(key)
            if sid is not None and self.tasks[sid].rank != task.rank:
                task.deps.append(sid)
        for t in self.tasks:
            for d in t.deps:
                self.tasks[d].dependents += 1


def build_workload(s: Scenario, layout: Layout | None = None, cost: CostModel | None = None,
                   costs: BlockCosts | None = None, fidelity: str | None = None) -> Workload:
    """Per-rank programs for one training step. ``costs`` may be given to price blocks
    differently (tests make stages exactly balanced this way)."""
    layout = layout or Layout(s.parallel.tp, s.parallel.pp, s.parallel.dp,
                              s.cluster.gpus_per_node or 1)
    cost = cost or CostModel(s.hardware, s.training.dtype)
    costs = costs or block_costs(s, cost)
    fidelity = fidelity or s.simulation.fidelity
    schedule = build_schedule(s.parallel.schedule, s.parallel.pp, s.microbatches,
                              s.parallel.virtual_stages)
    ranks = layout.representatives() if fidelity == "folded" else tuple(range(layout.world))
    b = _Builder(s, layout, cost, costs, schedule, ranks)
    with gc_paused():
        for r in ranks:
            b.build_rank(r)
        b.resolve()
    weight = float(s.parallel.tp * s.parallel.dp) if fidelity == "folded" else 1.0
    return Workload(b.programs, b.tasks, layout, schedule, weight, fidelity)

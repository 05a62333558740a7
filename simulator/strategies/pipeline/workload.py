"""Pipeline pass: the schedule's actions as compute tasks and point-to-point sends.

It walks each simulated rank's actions from :mod:`simulator.schedules.action` and calls
the other passes' hooks (:class:`~simulator.builder.context.Pass`) where their tasks
belong. An F, B or I of a virtual stage expands to per-layer blocks (attention, MLP) of
the layers :mod:`simulator.spec.placement` gives it (a stage with none, nor the embedding
or head, relays: one zero-second task) on the compute stream, with the embedding's on the
first stage and the output layer's on the last; B carries the weight gradients as well
(its task records that share in ``weight_s``), I only the input gradients, and W (ZB-H1,
Qi et al. 2024) one weight-gradient task per layer. Recomputation runs before each
layer's backward: the attention core only (``selective``) or the layer's whole forward
(``full``, with its TP collectives).

Activations after an F and input gradients after a B or I (b·s·h bytes per TP rank,
b·s·h/t with sequence parallelism, Megatron-core's p2p shapes) go out on the ``pp``
stream as soon as they are produced (on the compute stream without ``overlap.pp``); the
receiver's first compute of that action waits for the transfer. Sends are matched to
receivers once every rank is built.

Under ``torch.distributed.pipelining`` (a stack with ``pipeline_runtime: torch``) each F
and B (or I) action ends with the runtime's own host time where the profile measured it
(``gpu.pipeline_action_us``, on the host: only where the stack has a per-kernel host
cost, as DTensor's), on the compute stream before the action's send: the stage's Python
around the action (its receive and send ops, the chunk's autograd call) runs there.

Multi-token prediction modules (``model.mtp_layers``) are layers of the last stage;
each one's ends (the shifted tokens' embedding, norms and projection, its output layer
and loss) follow the output layer's loss forward and precede the layers backward, with
their TP collectives. A trainer's metric updates on the logits (``BlockCosts.metrics``)
follow each backward of the last stage, after its send and its gradients' reductions.

At the end of the step, the word embedding's gradient is all-reduced, where the last
stage keeps a copy (a tied output layer, multi-token prediction), between the first and
the last stage (Megatron's embedding group; kind ``embedding_tie``), after the data
pass's last buckets and before the optimizer step; under DualPipe, whose ranks r and
pp − 1 − r hold the same two model stages, each rank's reduced gradients are all-reduced
with the other copy's there too (kind ``dp``).
"""

from __future__ import annotations

from functools import partial

from simulator.builder.context import Context
from simulator.builder.stamp import Stamps
from simulator.builder.tasks import Stream, Task
from simulator.model import transformer as mdl
from simulator.model.inventory.recompute_comm import reissued
from simulator.schedules.action import Action
from simulator.spec.recompute import layer_mode
from simulator.strategies.pipeline import pairs


class PipelinePass:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        s = ctx.s
        self.act_bytes = mdl.pp_activation_bytes(s.model, s.training.micro_batch,
                                                 s.training.dtype)
        if s.parallel.sequence_parallel:  # the boundary tensor is [s/t, b, h] per TP rank
            self.act_bytes /= s.parallel.tp
        self.sends: dict[tuple[str, int, int, int], int] = {}  # (dir, stage, mb, rank) -> task
        self.peers: dict[tuple[int, int], int] = {}  # (rank, stage) -> its peer there
        self.waits: list[tuple[Task, tuple[str, int, int, int]]] = []
        # each (rank, kind, stage)'s actions built once and copied (simulator.builder.stamp)
        self.stamps = Stamps(ctx, self.waits, ctx.stamp)

    # ------------------------------------------------------------ driver
    def build_rank(self, rank: int) -> None:
        ctx, sched, hooks = self.ctx, self.ctx.sched, self.ctx.hooks
        compute = ctx.programs[rank].streams["compute"]
        stamped = self.stamps.action
        opens = pairs.pair_starts(ctx, ctx.layout.coord(rank).pp)  # DualPipe's F&B pairs
        begins: dict[int, int] = {}
        sides: dict[str, int] = {}  # the other streams' lengths where a pair begins
        for i, a in enumerate(sched.actions[ctx.layout.coord(rank).pp]):
            chunk = sched.chunk_of(a.stage)
            if opens:
                begins[i] = len(compute)
                if i in opens:
                    sides = {n: len(ts) for n, ts in ctx.programs[rank].streams.items()}
            if a.kind == "F":
                stamped(rank, "F", a.stage, a.microbatch, partial(self.forward, rank, a, chunk))
                self.runtime(rank, a, chunk)
                if not sched.is_last(a.stage):
                    self.send(rank, "act", a, compute[-1], a.stage + 1, chunk)
                continue
            if a.kind == "W":
                done = stamped(rank, "W", a.stage, a.microbatch,
                               partial(self.weight_grad, rank, a, chunk))
            else:
                done = stamped(rank, a.kind, a.stage, a.microbatch,
                               partial(self.backward, rank, a, chunk, a.kind == "B"))
                self.runtime(rank, a, chunk)
                if not sched.is_first(a.stage):
                    self.send(rank, "grad", a, compute[-1], a.stage - 1, chunk)
                if a.kind == "I":
                    self.metrics(rank, a, chunk)
                    continue
            for weight_grads in hooks.weight_grads:
                weight_grads(rank, i, a, done, chunk)
            if a.kind == "B":
                self.metrics(rank, a, chunk)
            if i - 1 in opens:
                pairs.interleave(ctx, rank, begins[i - 1], begins[i], sides)
        for sync_end in hooks.sync_end:
            sync_end(rank)
        self.embedding_tie(rank)
        pairs.copies_sum(self.ctx, rank)
        for step in hooks.step:
            step(rank)
        for after_step in hooks.after_step:
            after_step(rank)

    def resolve(self) -> None:
        """Make each action's first compute wait for the transfer it receives."""
        tasks, layout, clean = self.ctx.tasks, self.ctx.layout, self.ctx.clean_tp
        for task, key in self.waits:
            sid = self.sends.get(key)
            if sid is None and clean is not None:  # an odd TP index the sender's stage lacks
                c = layout.coord(key[3])
                sid = self.sends.get((*key[:3], layout.rank(c.pp, c.dp, clean, c.cp)))
            if sid is not None and tasks[sid].rank != task.rank:
                task.deps.append(sid)

    # ------------------------------------------------------------ actions
    def layer_start(self, rank: int, forward: bool, mb: int, layer: int,
                    chunk: int) -> list[int]:
        """Tasks on other streams that the layer's first compute waits for."""
        waits = []
        for layer_start in self.ctx.hooks.layer_start:
            t = layer_start(rank, forward, mb, layer, chunk)
            if t is not None and t.stream != "compute":
                waits.append(t.id)
        return waits

    def forward(self, rank: int, a: Action, chunk: int) -> Task:
        ctx, hooks, c, mb = self.ctx, self.ctx.hooks, self.ctx.c_of(rank), a.microbatch
        compute = ctx.programs[rank].streams["compute"]
        begin = len(compute)  # the action's first compute-stream task (see below)
        head: Task | None = None
        starts = []  # tasks on other streams the forward's first compute waits for
        for forward_start in hooks.forward_start:
            g = forward_start(rank, a.stage, mb, chunk)
            if g is not None and g.stream != "compute":
                starts.append(g.id)
        if ctx.sched.is_first(a.stage):
            head = ctx.compute(rank, "F", "forward", f"embed mb{mb}", c.embed[0], mb, -1, chunk)
            for edge in hooks.edge:
                edge(rank, "embed", True, mb, chunk)
        for layer in ctx.layers_of(a.stage):
            waits = self.layer_start(rank, True, mb, layer, chunk)
            for blk, label in ((0, "attn"), (1, "mlp")):
                for block in hooks.block:
                    block(rank, label, True, mb, layer, chunk, False)
                t = ctx.compute(rank, "F", "forward", f"fwd.{label} L{layer} mb{mb}",
                                c.layer(layer).fwd[blk], mb, layer, chunk)
                if blk == 0:
                    t.deps.extend(waits)
                head = head or t
                t = self.after_block(rank, label, mb, layer, chunk, False, t)
            for layer_end in hooks.layer_end:
                layer_end(rank, t)
        if ctx.sched.is_last(a.stage):
            for edge in hooks.edge:
                edge(rank, "head", True, mb, chunk)
            t = ctx.compute(rank, "F", "forward", f"head mb{mb}", c.head[0], mb, -1, chunk)
            head = head or t
            for loss in hooks.loss:
                loss(rank, mb, chunk)
            self.mtp_forward(rank, mb, chunk)
        if head is None:  # a stage without layers passes the activations on
            head = self.relay(rank, "F", mb, chunk)
        # what the action receives gates its first task on the compute stream, which may
        # be a collective before the first block (sequence parallelism's all-gather)
        first = _first_from(compute, begin, head)
        first.deps.extend(starts)
        if not ctx.sched.is_first(a.stage):
            self.waits.append((first, ("act", a.stage - 1, mb, rank)))
        return head

    def after_block(self, rank: int, label: str, mb: int, layer: int, chunk: int,
                    backward: bool, t: Task) -> Task:
        """The ``block(before=False)`` hooks after block task ``t``; the task that stands
        for the block afterwards (a pass that split it returns its last piece)."""
        for block in self.ctx.hooks.block:
            end = block(rank, label, False, mb, layer, chunk, backward)
            if end is not None:
                t = end
        return t

    def backward(self, rank: int, a: Action, chunk: int, weights: bool) -> list[Task]:
        """B (``weights``) or I: head, layers in reverse, embedding; returns the tasks
        that finish each layer's weight gradients (for the data pass)."""
        ctx, hooks, c, mb = self.ctx, self.ctx.hooks, self.ctx.c_of(rank), a.microbatch
        w = 1.0 if weights else 0.0
        op = "B" if weights else "I"
        compute = ctx.programs[rank].streams["compute"]
        begin = len(compute)
        first: Task | None = None
        done: list[Task] = []
        if ctx.sched.is_last(a.stage):
            first = ctx.compute(rank, op, "backward", f"head.bwd mb{mb}",
                                c.head[1] + w * c.head[2], mb, -1, chunk)
            first.weight_s = w * c.head[2]
            if not ctx.layers_of(a.stage):  # the head's gradients finish here (grad_bytes)
                done.append(first)
            for edge in hooks.edge:
                edge(rank, "head", False, mb, chunk)
            self.mtp_backward(rank, op, mb, chunk, w)
        for layer in reversed(ctx.layers_of(a.stage)):
            waits = self.layer_start(rank, False, mb, layer, chunk)
            if layer_mode(ctx.s.parallel, ctx.s.model.layers, layer) != "none":
                t = self.recompute(rank, mb, layer, chunk)
                first = first or t
                t.deps.extend(waits)
                waits = []
            lc = c.layer(layer)
            for blk, label in ((1, "mlp"), (0, "attn")):
                for block in hooks.block:
                    block(rank, label, True, mb, layer, chunk, True)
                t = ctx.compute(rank, op, "backward", f"bwd.{label} L{layer} mb{mb}",
                                lc.bwd_input[blk] + w * lc.bwd_weight[blk], mb, layer, chunk)
                t.weight_s = w * lc.bwd_weight[blk]
                if blk == 1:
                    t.deps.extend(waits)
                first = first or t
                t = self.after_block(rank, label, mb, layer, chunk, True, t)
            done.append(t)
            for layer_end in hooks.layer_end:
                layer_end(rank, t)
        if ctx.sched.is_first(a.stage):
            for edge in hooks.edge:
                edge(rank, "embed", False, mb, chunk)
            t = ctx.compute(rank, op, "backward", f"embed.bwd mb{mb}", w * c.embed[2], mb, -1,
                            chunk)
            t.weight_s = w * c.embed[2]
            first = first or t
            done.append(t)
        if first is None:  # a stage without layers passes the gradients on
            first = self.relay(rank, op, mb, chunk)
        if not ctx.sched.is_last(a.stage):  # as in forward: the action's first compute-stream task
            self.waits.append((_first_from(compute, begin, first),
                               ("grad", a.stage + 1, mb, rank)))
        return done

    def mtp_forward(self, rank: int, mb: int, chunk: int) -> None:
        """Each multi-token prediction module's ops outside its layer (its layer is among
        the stage's): the shifted tokens' embedding, norms and projection, its output
        layer and loss, with their TP collectives (the embedding's, the projection's, the
        output layer's, the loss's)."""
        ctx, hooks, c = self.ctx, self.ctx.hooks, self.ctx.c_of(rank)
        for depth in range(1, ctx.s.model.mtp_layers + 1):
            for where in ("embed", "mtp_proj", "head"):
                for edge in hooks.edge:
                    edge(rank, where, True, mb, chunk)
            ctx.compute(rank, "F", "forward", f"mtp{depth} mb{mb}", c.mtp[0], mb, -1, chunk)
            for loss in hooks.loss:
                loss(rank, mb, chunk)

    def mtp_backward(self, rank: int, op: str, mb: int, chunk: int, w: float) -> None:
        """The backward of :meth:`mtp_forward`, weight gradients included under B (``w``);
        under full recomputation the input side's forward first, with its TP collectives."""
        ctx, hooks, c = self.ctx, self.ctx.hooks, self.ctx.c_of(rank)
        for depth in range(1, ctx.s.model.mtp_layers + 1):
            if ctx.s.parallel.recompute == "full":
                for edge in hooks.edge:
                    edge(rank, "mtp_proj", True, mb, chunk)
                ctx.compute(rank, "R", "recompute", f"mtp{depth}.recompute mb{mb}",
                            c.mtp_recompute, mb, -1, chunk)
            t = ctx.compute(rank, op, "backward", f"mtp{depth}.bwd mb{mb}",
                            c.mtp[1] + w * c.mtp[2], mb, -1, chunk)
            t.weight_s = w * c.mtp[2]
            for where in ("head", "mtp_proj", "embed"):
                for edge in hooks.edge:
                    edge(rank, where, False, mb, chunk)

    def runtime(self, rank: int, a: Action, chunk: int) -> None:
        """The pipeline runtime's host time for one F or B/I action (``BlockCosts.action``),
        on the compute stream before the action's send."""
        seconds = self.ctx.c_of(rank).action
        if seconds:
            self.ctx.compute(rank, a.kind, "forward" if a.kind == "F" else "backward",
                             f"pp.runtime {a.kind} mb{a.microbatch}", seconds, a.microbatch,
                             -1, chunk)

    def metrics(self, rank: int, a: Action, chunk: int) -> None:
        """The trainer's metric updates on the logits after a backward (B or I) of the last
        stage (``BlockCosts.metrics``), once ``loss.backward()`` has returned: after its
        send and what the other passes issue for it (the gradients' reductions, and the
        compute stream's wait for them where the sharding makes it wait)."""
        seconds = self.ctx.c_of(rank).metrics
        if seconds and self.ctx.sched.is_last(a.stage):
            self.ctx.compute(rank, "F", "forward", f"metrics mb{a.microbatch}", seconds,
                             a.microbatch, -1, chunk)

    def relay(self, rank: int, op: str, mb: int, chunk: int) -> Task:
        """A zero-second task of a stage that holds no layers (a Megatron-LM identity
        stage): what the received transfer feeds and the next send follows."""
        kind = "forward" if op == "F" else "backward"
        return self.ctx.compute(rank, op, kind, f"relay mb{mb}", 0.0, mb, -1, chunk)

    def recompute(self, rank: int, mb: int, layer: int, chunk: int) -> Task:
        ctx, c = self.ctx, self.ctx.c_of(rank).layer(layer)
        if ctx.s.parallel.recompute != "full":  # selective or per-op: their own blocks
            return self.recompute_ops(rank, mb, layer, chunk)
        first = None
        for blk, label in ((0, "attn"), (1, "mlp")):
            for block in ctx.hooks.block:
                block(rank, label, True, mb, layer, chunk, False)
            t = ctx.compute(rank, "R", "recompute", f"recompute.{label} L{layer} mb{mb}",
                            c.recompute[blk], mb, layer, chunk)
            first = first or t
            self.after_block(rank, label, mb, layer, chunk, False, t)
        assert first is not None
        return first

    def recompute_ops(self, rank: int, mb: int, layer: int, chunk: int) -> Task:
        """Selective or per-op recomputation: the attention block's recomputed ops, then a
        finer policy's MLP-block ones (:mod:`simulator.model.inventory.recompute_policy`),
        each between the ``recompute_block`` hooks that issue again the collectives the
        policy's checkpointed function holds
        (:func:`simulator.model.inventory.recompute_comm.reissued`)."""
        ctx, c = self.ctx, self.ctx.c_of(rank).layer(layer)
        s = ctx.s
        again = reissued(layer_mode(s.parallel, s.model.layers, layer),
                         s.model.is_moe_layer(layer), s.parallel.sequence_parallel)
        first: Task | None = None
        for blk, label in ((0, "attn"), (1, "mlp")):
            if blk and not (c.recompute[1] or again.touches(label)):
                continue
            for hook in ctx.hooks.recompute_block:
                hook(rank, label, True, mb, layer, chunk, again)
            t = ctx.compute(rank, "R", "recompute", f"recompute.{label} L{layer} mb{mb}",
                            c.recompute[blk], mb, layer, chunk)
            first = first or t
            for hook in ctx.hooks.recompute_block:
                hook(rank, label, False, mb, layer, chunk, again)
        assert first is not None
        return first

    def weight_grad(self, rank: int, a: Action, chunk: int) -> list[Task]:
        ctx, c, mb = self.ctx, self.ctx.c_of(rank), a.microbatch
        done = []
        if ctx.sched.is_last(a.stage):
            t = ctx.compute(rank, "W", "weight_grad", f"head.wgrad mb{mb}", c.head[2], mb, -1,
                            chunk)
            if not ctx.layers_of(a.stage):  # the head's gradients finish here (grad_bytes)
                done.append(t)
            for depth in range(1, ctx.s.model.mtp_layers + 1):
                ctx.compute(rank, "W", "weight_grad", f"mtp{depth}.wgrad mb{mb}", c.mtp[2], mb,
                            -1, chunk)
        for layer in reversed(ctx.layers_of(a.stage)):
            done.append(ctx.compute(rank, "W", "weight_grad", f"wgrad L{layer} mb{mb}",
                                    sum(c.layer(layer).bwd_weight), mb, layer, chunk))
        if ctx.sched.is_first(a.stage):
            done.append(ctx.compute(rank, "W", "weight_grad", f"embed.wgrad mb{mb}",
                                    c.embed[2], mb, -1, chunk))
        return done

    def send(self, rank: int, direction: str, a: Action, after: Task, to_stage: int,
             chunk: int) -> None:
        ctx, stage, mb = self.ctx, a.stage, a.microbatch
        dst = self.peers.get((rank, to_stage))
        if dst is None:  # the rank of the same (dp, tp, cp) on the other stage
            coord = ctx.layout.coord(rank)
            dst = self.peers[(rank, to_stage)] = ctx.layout.rank(
                ctx.sched.rank_of(to_stage), coord.dp, coord.tp, coord.cp)
        stream: Stream = "pp" if ctx.overlap.pp else "compute"  # built positionally
        t = ctx.put(Task(len(ctx.tasks), rank, stream, "pp.send", "pp",
                         f"pp.send {direction} s{stage}->s{to_stage} mb{mb}", 0.0, None, (),
                         (), dst, self.act_bytes, mb, -1, chunk, [after.id]))
        self.sends[(direction, stage, mb, dst)] = t.id

    # ------------------------------------------------------------ end of step
    def embedding_tie(self, rank: int) -> None:
        """All-reduce the tied embedding's gradient between the first and last stage."""
        ctx, coord, par = self.ctx, self.ctx.layout.coord(rank), self.ctx.s.parallel
        last = ctx.sched.rank_of(ctx.last_stage)
        if not ctx.tied_copy_params() or coord.pp not in (0, last):
            return
        group = (ctx.layout.rank(0, coord.dp, coord.tp, coord.cp),
                 ctx.layout.rank(last, coord.dp, coord.tp, coord.cp))
        size = ctx.tied_copy_params() / par.tp * ctx.dt_bytes
        ctx.collective(rank, "compute", "all_reduce", "embedding_tie", group, size,
                       "embedding_tie.all_reduce tied embedding grads")


def _first_from(compute: list[Task], begin: int, fallback: Task) -> Task:
    """An action's first compute-stream task (it was added at index ``begin``), or
    ``fallback`` where the action added none."""
    return compute[begin] if len(compute) > begin else fallback

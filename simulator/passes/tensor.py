"""Tensor-parallel pass: Megatron-LM's collectives on the compute stream.

Per layer and micro-batch, two collectives in forward and two in backward
(Shoeybi et al. 2019, §3): an all-reduce after the attention block and after
the MLP block; with sequence parallelism (Korthikanti et al. 2022, §4.2.2) an
all-gather before each block and a reduce-scatter after it instead, in both
directions, of the same b·s·h activation. Full recomputation repeats the
forward's collectives. They run on the compute stream: the next block needs
their result.

The vocab-parallel ends (Megatron's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``): the embedding's partial sums are
all-reduced (reduce-scattered with SP) after its forward, and with SP its
backward all-gathers the incoming gradient; the output layer takes a replicated
input (all-gathered with SP) and all-reduces (reduce-scatters) its input
gradient in backward; the cross-entropy all-reduces three fp32 values per
token (the logits' max, the target logit, the sum of exponentials).

Installed only when tp > 1 (a group of one has no collective).
"""

from __future__ import annotations

from simulator import model as mdl
from simulator.hardware import CollectiveName
from simulator.passes.context import Context, Pass


class TensorPass(Pass):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        s = ctx.s
        self.sp = s.parallel.sequence_parallel
        self.tp_bytes = mdl.tp_comm_bytes_per_layer(s.model, s.training.micro_batch,
                                                    s.training.dtype)
        self.loss_bytes = 4.0 * (s.training.micro_batch * s.model.seq_len)  # fp32 per token

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int) -> None:
        """All-reduce after a block, or with SP all-gather before and reduce-scatter after."""
        if before and not self.sp:
            return
        op: CollectiveName = ("all_gather" if before else "reduce_scatter") if self.sp \
            else "all_reduce"
        self.ctx.collective(rank, "compute", op, "tp", self.ctx.layout.tp_group(rank),
                            self.tp_bytes, f"tp.{op} L{layer} mb{mb}", mb, layer, chunk)

    def edge(self, rank: int, where: str, forward: bool, mb: int, chunk: int) -> None:
        sp = self.sp
        if where == "embed":
            op: CollectiveName | None = ("reduce_scatter" if sp else "all_reduce") if forward \
                else ("all_gather" if sp else None)
        else:
            op = ("all_gather" if sp else None) if forward \
                else ("reduce_scatter" if sp else "all_reduce")
        if op is not None:
            self.ctx.collective(rank, "compute", op, "tp", self.ctx.layout.tp_group(rank),
                                self.tp_bytes, f"tp.{op} {where} mb{mb}", mb, -1, chunk)

    def loss(self, rank: int, mb: int, chunk: int) -> None:
        for what in ("max", "target", "sum"):
            self.ctx.collective(rank, "compute", "all_reduce", "tp",
                                self.ctx.layout.tp_group(rank), self.loss_bytes,
                                f"tp.all_reduce loss {what} mb{mb}", mb, -1, chunk)

"""Context-parallel pass: the key/value exchange of attention over the CP group.

With context parallelism each rank holds s/cp tokens of every sequence (two
chunks, for causal load balance) and every op but attention runs on them alone
(:func:`simulator.builder.workload.block_costs` prices the attention core against the
whole sequence's keys). Attention needs the other ranks' keys and values; two
ways of getting them, Megatron-LM's ``--cp-comm-type`` (its context-parallel
guide, ``docs/source/api-guide/context_parallel.rst``):

- ``p2p`` (ring attention, Liu et al. 2023; Transformer Engine's default): the
  KV chunks travel around the CP ring in cp − 1 steps while the attention of the
  chunk already there is computed. Modelled as an all-gather ring of the rank's
  KV chunk on a ``cp`` stream that starts with the attention block and that the
  next block waits for: the exposed part is what the block's compute does not
  hide. The backward sends the KV chunks around again and the KV gradients back
  (twice the bytes).
- ``allgather`` (the Llama 3 report, §3.3.2): the keys and values are
  all-gathered before the attention core, on the compute stream (blocking); the
  backward all-gathers them again (Transformer Engine keeps only the chunk) and
  reduce-scatters their gradients after it. A stack that keeps the gathered ones
  (``stack.cp_kv_backward: saved``, an autograd all-gather whose output attention
  saves) skips the backward's all-gather.

Recomputed attention blocks (full recomputation) exchange as a forward does.
The gradients of every weight reduce over the data-parallel group with CP
(:meth:`simulator.system.layout.Layout.dp_group`). Installed only when cp > 1.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.model.inventory.attention import cp_kv_bytes


class ContextParallelPass(Pass):
    stamps = True  # per attention block; the ring follows the task before the block
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        s = ctx.s  # the rank's local view: seq_len / cp tokens
        self.kv = cp_kv_bytes(s.model, s.training.micro_batch, s.parallel.tp,
                                  s.training.dtype)
        self.cp = s.parallel.cp
        self.ring = s.parallel.cp_comm_type == "p2p"
        self.kept = s.cp_keeps_gathered_kv  # no all-gather again in backward
        for prog in ctx.programs.values():
            prog.streams.setdefault("cp", [])

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int, backward: bool) -> None:
        if label != "attn":
            return
        ctx = self.ctx
        group = ctx.layout.cp_group(rank)
        compute = ctx.programs[rank].streams["compute"]
        gathered = self.cp * self.kv  # the whole sequence's keys and values
        if before:
            if not self.ring and not (backward and self.kept):  # every chunk's K and V
                ctx.collective(rank, "compute", "all_gather", "cp", group, gathered,
                               f"cp.all_gather kv L{layer} mb{mb}", mb, layer, chunk)
            return
        # the attention block just added (a TP collective may follow it)
        at = next(i for i in range(len(compute) - 1, -1, -1) if compute[i].plan is None)
        block = compute[at]
        backward = block.op in ("B", "I")
        if not self.ring:
            if backward:  # the keys' and values' gradients back to their owners
                ctx.collective(rank, "compute", "reduce_scatter", "cp", group, gathered,
                               f"cp.reduce_scatter dkv L{layer} mb{mb}", mb, layer, chunk)
            return
        ring = ctx.collective(rank, "cp", "all_gather", "cp", group,
                              (2 if backward else 1) * gathered,
                              f"cp.ring {'kv+dkv' if backward else 'kv'} L{layer} mb{mb}",
                              mb, layer, chunk)
        if ring is None:
            return
        if at > 0:  # the ring starts with the block
            ring.deps.append(compute[at - 1].id)
        sync = ctx.compute(rank, block.op, block.kind, f"cp.wait L{layer} mb{mb}", 0.0, mb,
                           layer, chunk)
        sync.deps.append(ring.id)

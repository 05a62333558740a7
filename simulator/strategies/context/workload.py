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

- ``a2a`` (DeepSpeed-Ulysses, Jacobs et al. 2023; Transformer Engine's
  ``AttnFuncWithCPAndQKVOA2A``): an all-to-all over the CP group per tensor turns
  Q, K and V from s/cp tokens of the TP rank's heads into all s tokens of 1/cp of
  them before the core, and one turns the output back after it; the backward
  sends dO in and dQ, dK, dV out. Blocking, on the compute stream (TE waits for
  them before the kernel). Each all-to-all moves (cp − 1)/cp of its tensor.
- ``a2a+p2p`` (TE's ``AttnFuncWithCPAndKVP2P`` given two groups): those
  all-to-alls within groups of ``cp_a2a`` consecutive CP ranks, and a ring over
  the cp / cp_a2a ranks of the same index in the other groups
  (:meth:`simulator.system.layout.Layout.cp_ring_group`), overlapped with the core
  as ``p2p``'s.

Recomputed attention cores (full recomputation, and Megatron's ``core_attn``, whose
checkpointed core holds Transformer Engine's exchange:
:mod:`simulator.model.inventory.recompute_comm`) exchange again as a forward does.
The gradients of every weight reduce over the data-parallel group with CP
(:meth:`simulator.system.layout.Layout.dp_group`). Installed only when cp > 1.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.model.inventory.attention import cp_a2a_bytes, cp_kv_bytes
from simulator.model.inventory.recompute_comm import Reissue

A2A_IN = ("q", "k", "v")  # before the core, forward (the backward sends dO)
A2A_OUT = ("dq", "dk", "dv")  # after the core, backward (the forward sends O)


class ContextParallelPass(Pass):
    stamps = True  # per attention block; the ring follows the task before the block
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        s = ctx.s  # the rank's local view: seq_len / cp tokens
        self.kv = cp_kv_bytes(s.model, s.training.micro_batch, s.parallel.tp,
                                  s.training.dtype)
        self.a2a = s.parallel.cp_a2a_degree
        self.qkv = cp_a2a_bytes(s.model, s.training.micro_batch, s.parallel.tp,
                                s.training.dtype)
        self.cp = s.parallel.cp // self.a2a  # the ring's (or the all-gather's) ranks
        self.ring = s.parallel.cp_comm_type in ("p2p", "a2a+p2p")
        self.gather = s.parallel.cp_comm_type == "allgather"
        self.kept = s.cp_keeps_gathered_kv  # no all-gather again in backward
        for prog in ctx.programs.values():
            prog.streams.setdefault("cp", [])

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int, backward: bool) -> None:
        if label != "attn":
            return
        ctx = self.ctx
        inner, group = ctx.layout.cp_a2a_group(rank), ctx.layout.cp_ring_group(rank)
        compute = ctx.programs[rank].streams["compute"]
        gathered = self.cp * self.kv  # the whole sequence's keys and values (the ring's)
        if before:
            self.all_to_all(rank, inner, ("do",) if backward else A2A_IN, mb, layer, chunk)
            if self.gather and not (backward and self.kept):  # every chunk's K and V
                ctx.collective(rank, "compute", "all_gather", "cp", group, gathered,
                               f"cp.all_gather kv L{layer} mb{mb}", mb, layer, chunk)
            return
        # the attention block just added (a TP collective may follow it)
        at = next(i for i in range(len(compute) - 1, -1, -1) if compute[i].plan is None)
        block = compute[at]
        backward = block.op in ("B", "I")
        if self.ring:
            self.ring_exchange(rank, group, at, backward, mb, layer, chunk)
        elif self.gather and backward:  # the keys' and values' gradients back to their owners
            ctx.collective(rank, "compute", "reduce_scatter", "cp", group, gathered,
                           f"cp.reduce_scatter dkv L{layer} mb{mb}", mb, layer, chunk)
        self.all_to_all(rank, inner, A2A_OUT if backward else ("o",), mb, layer, chunk)

    def recompute_block(self, rank: int, label: str, before: bool, mb: int, layer: int,
                        chunk: int, again: Reissue) -> None:
        """A recomputed attention core (Megatron's ``core_attn``) exchanges again as a
        forward does: the exchange is inside the checkpointed core."""
        if again.cp:
            self.block(rank, label, before, mb, layer, chunk, False)

    def all_to_all(self, rank: int, group: tuple[int, ...], names: tuple[str, ...], mb: int,
                   layer: int, chunk: int) -> None:
        """One blocking all-to-all per tensor, each of its rank's chunk (none without
        the all-to-all variants: a group of one)."""
        for name in names:
            size = self.qkv[0] if name in ("q", "o", "do", "dq") else self.qkv[1]
            self.ctx.collective(rank, "compute", "all_to_all", "cp", group, size,
                                f"cp.all_to_all {name} L{layer} mb{mb}", mb, layer, chunk)

    def ring_exchange(self, rank: int, group: tuple[int, ...], at: int, backward: bool,
                      mb: int, layer: int, chunk: int) -> None:
        """The KV chunks around the ring on the cp stream, from the start of the attention
        block at ``at`` of the compute stream; a zero-second task there waits for it."""
        ctx = self.ctx
        compute = ctx.programs[rank].streams["compute"]
        block = compute[at]
        ring = ctx.collective(rank, "cp", "all_gather", "cp", group,
                              (2 if backward else 1) * (self.cp * self.kv),
                              f"cp.ring {'kv+dkv' if backward else 'kv'} L{layer} mb{mb}",
                              mb, layer, chunk)
        if ring is None:
            return
        if at > 0:  # the ring starts with the block
            ring.deps.append(compute[at - 1].id)
        sync = ctx.compute(rank, block.op, block.kind, f"cp.wait L{layer} mb{mb}", 0.0, mb,
                           layer, chunk)
        sync.deps.append(ring.id)

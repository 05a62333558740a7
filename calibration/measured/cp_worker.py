"""torchrun worker of ``clustersim measure --cp N``: the small GPT with its sequence split
over N context-parallel ranks, attention by all-gathering keys and values (the
``allgather`` variant of Megatron-LM's ``--cp-comm-type``, the Llama 3 report §3.3.2).

Launched like :mod:`calibration.measured.parallel_worker`, whose timing, profiling and
``measured.json`` it borrows; every rank reads the same
:class:`~calibration.measured.measure_config.MeasureConfig`.

Layout (Megatron's tp-cp-dp order, no TP or PP here): ``rank = dp_idx · cp + cp_idx``;
the ranks of one data-parallel replica form its CP group and share its batch.

Load-balanced chunks (Megatron-LM's ``get_batch_on_this_cp_rank``): each sequence is
cut into 2·cp chunks of L = s / (2·cp) tokens and CP rank r holds chunks r and
2·cp − 1 − r, so under the causal mask every rank has the same attention work.
Every op but the attention core runs on the rank's s / cp tokens; the learned
position embedding takes the tokens' global positions.

Attention (:class:`CPAttention`): the rank's K and V (stacked, one tensor) are
all-gathered over the CP group by :class:`GatherKV` — ``all_gather_into_tensor``
forward, ``reduce_scatter_single`` of their gradients backward, so each owner gets
the sum over every rank's queries — and put back in sequence order. Each local
chunk c attends to the keys of positions 0 .. (c+1)·L − 1 with the causal mask on
its diagonal block (Transformer Engine's ``AttnFuncWithCPAndKVAllGather`` slices the
keys the same way), so rank r's core costs (2·cp + 1)·L² per head, the same on every
rank. One difference from Transformer Engine: TE keeps only the local K/V for the
backward and all-gathers them again there; autograd here keeps the gathered ones, so the
backward has the reduce-scatter and no second all-gather (the ``pytorch-eager`` stack's
``cp_kv_backward: saved``, which the simulation of these runs reads).

Gradients: the model is wrapped in ``DistributedDataParallel`` over all dp · cp
ranks (the simulator reduces weight gradients over dp · cp), which averages them; the
loss of a rank is the mean over its own tokens, equal in number on every rank, so the
average of the ranks' gradients is the gradient of the whole sequence's mean loss.
:func:`equivalence` checks that against the same model without CP.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch.distributed.elastic.multiprocessing.errors import record

from calibration.measured.gpt import GPT, Attention, Embedding, GPTConfig, loss_fn, synthetic_batch
from calibration.measured.measure_config import MeasureConfig
from calibration.measured.worker_run import autocast_for, record_run, worker_main


def chunk_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens: chunks ``rank`` and 2·cp − 1 − ``rank``
    of 2·cp equal chunks, in that order."""
    if seq % (2 * cp):
        raise ValueError(f"model.seq_len={seq}: not divisible by 2·cp={2 * cp}")
    size = seq // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * size, (first + 1) * size),
                      torch.arange(second * size, (second + 1) * size)])


class GatherKV(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class CPAttention(Attention):
    """Causal attention of this rank's two chunks against the all-gathered keys."""

    def __init__(self, cfg: GPTConfig, cp: int, cp_rank: int, group: dist.ProcessGroup) -> None:
        super().__init__(cfg)
        self.cp, self.group = cp, group
        self.chunk = cfg.seq_len // (2 * cp)
        self.chunks = (cp_rank, 2 * cp - 1 - cp_rank)
        # gathered rank-major [r0: c0, c_{2cp-1}; r1: c1, c_{2cp-2}; ...] -> sequence order
        gathered = torch.cat([chunk_positions(cfg.seq_len, cp, r) for r in range(cp)])
        self.register_buffer("order", torch.argsort(gathered), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        shape = (batch, seq, -1, self.head_dim)
        q = self.q(x).view(shape).transpose(1, 2)
        kv = torch.stack([self.k(x).view(shape).transpose(1, 2),
                          self.v(x).view(shape).transpose(1, 2)])  # [2, b, heads, s/cp, d]
        every = GatherKV.apply(kv, self.group)  # [cp·2, b, heads, s/cp, d]
        every = every.view(self.cp, *kv.shape).permute(1, 2, 3, 0, 4, 5)
        every = every.reshape(2, batch, kv.shape[2], self.cp * seq, self.head_dim)
        k, v = every.index_select(3, self.order).unbind(0)
        outs = []
        for i, c in enumerate(self.chunks):
            size, end = self.chunk, (c + 1) * self.chunk
            rows = torch.arange(c * size, end, device=x.device)
            mask = torch.arange(end, device=x.device) <= rows[:, None]
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * size:(i + 1) * size], k[:, :, :end], v[:, :, :end], attn_mask=mask))
        y = torch.cat(outs, dim=2)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class CPEmbedding(Embedding):
    """Token embedding plus the learned position embedding of the tokens' global positions."""

    def __init__(self, cfg: GPTConfig, positions: torch.Tensor) -> None:
        super().__init__(cfg)
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.pos is not None  # GPT-2's block only (measure_config._arch_problems)
        return self.tok(tokens) + self.pos(self.positions)


def cp_model(cfg: GPTConfig, seed: int, cp: int, cp_rank: int,
             group: dist.ProcessGroup) -> GPT:
    """The GPT of ``seed`` (the same weights as without CP), its attention and embedding
    swapped for their CP forms; parameter names are unchanged."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    assert model.embed is not None
    embed = CPEmbedding(cfg, chunk_positions(cfg.seq_len, cp, cp_rank))
    embed.load_state_dict(model.embed.state_dict())
    model.embed = embed
    for block in model.layers.values():
        attn = CPAttention(cfg, cp, cp_rank, group)
        assert isinstance(block.attn, Attention)
        attn.load_state_dict(block.attn.state_dict())
        block.attn = attn
    model.tie_weights()
    return model


def local_tokens(tokens: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's columns of a ``batch x seq`` token tensor."""
    return tokens[:, chunk_positions(tokens.shape[1], cp, cp_rank).to(tokens.device)]


def cp_groups(cp: int) -> tuple[dist.ProcessGroup, int, int]:
    """(this rank's CP group, its dp index, its cp index); ``new_group`` is collective,
    so every rank creates every group in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, cp):
        group = dist.new_group(list(range(first, first + cp)))
        if first <= rank < first + cp:
            mine = group
    assert mine is not None
    return mine, rank // cp, rank % cp


class CPTrainer:
    """One optimizer step of the GPT with context and data parallelism, as a callable."""

    def __init__(self, cfg: MeasureConfig, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.cfg, self.device = cfg, device
        group, dp_idx, cp_idx = cp_groups(cfg.cp)
        self.coords = {"pp": 0, "dp": dp_idx, "tp": 0, "cp": cp_idx}
        gcfg = GPTConfig.from_dict(cfg.model)
        self.model = cp_model(gcfg, cfg.seed, cfg.cp, cp_idx, group).to(device)
        batch = cfg.micro_batch_size * cfg.micro_batches
        inputs, targets = synthetic_batch(gcfg, batch, cfg.seed + 1 + dp_idx, device)
        self.inputs = local_tokens(inputs, cfg.cp, cp_idx)
        self.targets = local_tokens(targets, cfg.cp, cp_idx)
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.autocast = autocast_for(device)

    def __call__(self) -> torch.Tensor:
        m = self.cfg.micro_batches
        total = torch.zeros((), device=self.device)
        pairs = zip(self.inputs.chunk(m), self.targets.chunk(m), strict=True)
        for i, (x, y) in enumerate(pairs):
            with nullcontext() if i == m - 1 else self.ddp.no_sync():
                with self.autocast():
                    loss = loss_fn(self.ddp(x), y) / m
                loss.backward()
            total += loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def equivalence(cfg: GPTConfig, batch: int, seed: int = 0) -> dict[str, float]:
    """Run in a process group of cp ranks (the world): one forward and backward of the CP
    model and of the plain model on the same batch; returns the largest absolute
    differences of the loss and of any parameter's gradient (CP gradients averaged over
    the ranks, as DDP does)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    model = cp_model(cfg, seed, cp, rank, dist.group.WORLD)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reference = GPT(cfg)
    inputs, targets = synthetic_batch(cfg, batch, seed + 1)
    loss = loss_fn(model(local_tokens(inputs, cp, rank)), local_tokens(targets, cp, rank))
    loss.backward()
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    full = loss_fn(reference(inputs), targets)
    full.backward()
    diffs = {"loss": abs(float(whole) / cp - float(full))}
    grads = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad.clone()
        dist.all_reduce(g)
        ref = grads[name].grad
        assert ref is not None, name
        worst = max(worst, float((g / cp - ref).abs().max()))
    diffs["grad"] = worst
    diffs["grad_scale"] = max(float(p.grad.abs().max()) for p in reference.parameters()
                              if p.grad is not None)
    return diffs


def run(cfg: MeasureConfig, device: torch.device) -> None:
    record_run(CPTrainer(cfg, device), cfg, device)


@record
def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, __doc__.splitlines()[0], run)


if __name__ == "__main__":
    sys.exit(main())

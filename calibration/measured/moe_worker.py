"""torchrun worker of ``clustersim measure --experts E --ep N``: the small GPT with every
MLP replaced by E routed experts (top-k), trained with expert parallelism.

Launched like :mod:`calibration.measured.parallel_worker` (which it borrows its timing,
profiling and ``measured.json`` from); every rank reads the same
:class:`~calibration.measured.measure_config.MeasureConfig`.

The MoE layer (:class:`MoEMLP`) is GShard's and Switch Transformer's, the form
Megatron-core runs with ``--moe-expert-capacity-factor`` and padding: a router
(h → E, no bias, softmax), the top-k experts per token with their probabilities
renormalised (Mixtral), and a buffer of C = ⌈c · k · T / E⌉ token slots per expert
(tokens beyond it are dropped, empty slots stay zero), so every all-to-all has the
same size whatever the router does. The buffers of the E/ep experts of each EP rank
are contiguous; ``torch.distributed.nn.functional.all_to_all_single`` (autograd: its
backward is the reverse all-to-all) sends them to their rank (dispatch), the rank runs
its experts one after another (Megatron-core's ``SequentialMLP``; a CPU runs the
GEMMs of a grouped call in turn anyway) over the ep · C tokens each received, and a
second all-to-all brings the outputs home (combine), where each token sums its k
weighted outputs. Backward is the mirror, two all-to-alls of the same size.

Data and expert parallelism: the dp ranks each draw their own batch; the experts are
split over EP groups of ``ep`` consecutive ranks (Megatron's order, expert ranks
carved out of dp), and their gradients are all-reduced over the ranks holding the same
experts (edp = dp / ep, none when ep = dp); every other parameter's gradient is
all-reduced over all dp ranks once per step, after the last micro-batch's backward,
as one flat buffer (the scenario says one DDP bucket).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.nn.functional import all_to_all_single

from calibration.measured.gpt import GPT, MLP, GPTConfig, loss_fn, synthetic_batch
from calibration.measured.measure_config import MeasureConfig
from calibration.measured.worker_run import autocast_for, record_run, worker_main


class MoEMLP(nn.Module):
    """Top-k routed experts with capacity buffers, E/ep of them on this rank."""

    def __init__(self, cfg: GPTConfig, experts: int, top_k: int, capacity_factor: float,
                 ep: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        h, local = cfg.hidden, experts // ep
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.ep, self.local, self.group = ep, local, group
        self.router = nn.Linear(h, experts, bias=False)
        self.local_experts = nn.ModuleList(MLP(cfg) for _ in range(local))
        for expert in self.local_experts:
            assert isinstance(expert, MLP)
            nn.init.normal_(expert.up.weight, 0.0, 0.02)
            nn.init.normal_(expert.down.weight, 0.0, 0.02 / math.sqrt(2 * cfg.layers))
            nn.init.zeros_(expert.up.bias)
            nn.init.zeros_(expert.down.bias)

    def capacity(self, tokens: int) -> int:
        return math.ceil(self.capacity_factor * self.top_k * tokens / self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1]
        tokens = x.reshape(-1, h)
        n, e, k = tokens.shape[0], self.experts, self.top_k
        cap = self.capacity(n)
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, idx = probs.topk(k, dim=-1)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        choice = idx.reshape(-1)  # token-major: token t's k choices are rows t·k .. t·k+k-1
        onehot = F.one_hot(choice, e)
        slot_in_expert = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
        keep = slot_in_expert < cap
        slot = choice * cap + slot_in_expert.clamp(max=cap - 1)
        source = torch.arange(n, device=x.device).repeat_interleave(k)
        buf = tokens.new_zeros(e * cap, h).index_copy(0, slot[keep], tokens[source[keep]])
        received = self.exchange(buf)  # [ep sources x local experts x cap, h]
        y = received.view(self.ep, self.local, cap, h).transpose(0, 1).reshape(
            self.local, self.ep * cap, h)
        y = torch.stack([self.expert(y[j], j) for j in range(self.local)])
        back = y.view(self.local, self.ep, cap, h).transpose(0, 1).reshape(e * cap, h)
        out = self.exchange(back)  # the combine: outputs home, in dispatch order
        weight = (gate.reshape(-1) * keep).unsqueeze(-1)
        return (out[slot] * weight).view(n, k, h).sum(dim=1).view_as(x)

    def expert(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Local expert ``j`` on its ep · C tokens (Megatron's SequentialMLP: one GEMM
        pair per expert)."""
        out: torch.Tensor = self.local_experts[j](x)
        return out

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """All-to-all of equal slices (autograd: the backward is the reverse exchange)."""
        if self.ep == 1:
            return buf
        return all_to_all_single(torch.empty_like(buf), buf.contiguous(), group=self.group)


def groups(cfg: MeasureConfig) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's EP group, its expert data-parallel group); ``new_group`` is collective,
    so every rank creates every group in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_group = edp_group = None
    for first in range(0, world, cfg.ep):
        ranks = list(range(first, first + cfg.ep))
        g = dist.new_group(ranks) if cfg.ep > 1 else None
        if rank in ranks:
            ep_group = g
    for offset in range(cfg.ep):
        ranks = list(range(offset, world, cfg.ep))
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            edp_group = g
    return ep_group, edp_group


class MoETrainer:
    """One optimizer step of the MoE GPT with expert and data parallelism, as a callable."""

    def __init__(self, cfg: MeasureConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        rank = dist.get_rank()
        self.coords = {"pp": 0, "dp": rank, "tp": 0}
        gcfg = GPTConfig.from_dict(cfg.model)
        ep_group, self.edp_group = groups(cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)  # dense weights equal on every rank
            self.model = GPT(gcfg)
            torch.manual_seed(cfg.seed + 100 + rank % cfg.ep)  # each EP rank its own experts
            for block in self.model.layers.values():
                block.mlp = MoEMLP(gcfg, cfg.experts, cfg.experts_per_token,
                                   cfg.capacity_factor, cfg.ep, ep_group)
        self.model.to(device)
        batch = cfg.micro_batch_size * cfg.micro_batches
        self.inputs, self.targets = synthetic_batch(gcfg, batch, cfg.seed + 1 + rank, device)
        params = list(self.model.parameters())
        self.expert = [p for n, p in self.model.named_parameters() if ".local_experts." in n]
        ids = {id(p) for p in self.expert}
        self.dense = [p for p in params if id(p) not in ids]
        self.optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)
        self.autocast = autocast_for(device)

    def __call__(self) -> torch.Tensor:
        m = self.cfg.micro_batches
        total = torch.zeros((), device=self.device)
        for x, y in zip(self.inputs.chunk(m), self.targets.chunk(m), strict=True):
            with self.autocast():
                loss = loss_fn(self.model(x), y) / m
            loss.backward()
            total += loss.detach()
        self.reduce(self.dense, None)
        if self.edp_group is not None:
            self.reduce(self.expert, self.edp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def reduce(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        """Average the gradients of ``params`` over ``group`` (the world: None) at once."""
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def run(cfg: MeasureConfig, device: torch.device) -> None:
    start = time.perf_counter()
    record_run(MoETrainer(cfg, device), cfg, device)
    print(f"moe worker done in {time.perf_counter() - start:.1f} s", file=sys.stderr)


@record
def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, __doc__.splitlines()[0], run)


if __name__ == "__main__":
    sys.exit(main())

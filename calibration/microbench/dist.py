"""What the microbenchmarks of the collectives' torchrun launch share: device
synchronisation, the slowest rank's figure, every rank's figures, timed loops, the
collectives as callables, and how a size and a set of rounds are read.

The collective sweep (:mod:`calibration.microbench.collectives_worker`) and the two-rank
terms (:mod:`calibration.microbench.terms`) time alike: a loop starts after a group
barrier and each call is timed to a device synchronisation, a figure of one rank is
reduced over the group (the slowest rank's: the collective is done when the last rank
is) or gathered (every rank's, for a term that compares ranks). ``group`` is a
``torch.distributed`` process group, ``dev`` the tensors' device (``"cpu"`` or
``"cuda:N"``). torch is imported inside each helper.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def sync(dev: str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if dev.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def rank_max(x: float, group: Any, dev: str) -> float:
    """The largest ``x`` over the ranks of ``group``: the slowest rank's figure."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def gather(values: list[float], group: Any, dev: str) -> list[list[float]]:
    """Every rank's ``values``, transposed: one list per value, one entry per rank."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64, device=dev)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [list(col) for col in zip(*(t.tolist() for t in out), strict=True)]


def timed_loop(call: Callable[[], object], group: Any, dev: str,
               aligned: bool = False) -> Callable[[int], list[float]]:
    """Seconds of each of ``k`` calls started after a group barrier (``aligned``: each
    call after its own, as the collective benchmark times a call), each timed to a
    device synchronisation."""
    import torch.distributed as dist

    def run(k: int) -> list[float]:
        dist.barrier(group=group)
        sync(dev)
        out: list[float] = []
        for _ in range(k):
            if aligned and out:
                dist.barrier(group=group)
                sync(dev)
            t0 = time.perf_counter()
            call()
            sync(dev)
            out.append(time.perf_counter() - t0)
        return out
    return run


def make_call(op: str, n: int, size: int, group: Any, dev: str,
              rank: int) -> tuple[Callable[[int], Any], int, int]:
    """One call of collective ``op`` on ``n`` ranks at ``size`` bytes as nccl-tests
    sizes it, over a few sets of fresh buffers: ``(call(set index), sets, bytes)``."""
    import torch
    import torch.distributed as dist

    numel = max(n, size // 4 // n * n)
    nbytes = numel * 4
    per_set = nbytes * (2 if op in ("all_gather", "reduce_scatter", "send_recv", "all_to_all")
                        else 1)
    nbuf = max(1, min(4, int(256e6 // per_set)))  # a few sets; caches matter little at these sizes

    def rnd(k: int) -> Any:
        return torch.empty(k, device=dev).uniform_(-1, 1)

    if op == "all_reduce":
        bufs = [rnd(numel) for _ in range(nbuf)]
        return (lambda i: dist.all_reduce(bufs[i], group=group)), nbuf, nbytes
    if op == "broadcast":
        bufs = [rnd(numel) for _ in range(nbuf)]
        return (lambda i: dist.broadcast(bufs[i], src=0, group=group)), nbuf, nbytes
    if op == "all_gather":
        ins = [rnd(numel // n) for _ in range(nbuf)]
        outs = [torch.empty(numel, device=dev) for _ in range(nbuf)]
        return (lambda i: dist.all_gather_into_tensor(outs[i], ins[i], group=group)), nbuf, nbytes
    if op == "reduce_scatter":
        ins = [rnd(numel) for _ in range(nbuf)]
        outs = [torch.empty(numel // n, device=dev) for _ in range(nbuf)]
        return (lambda i: dist.reduce_scatter_tensor(outs[i], ins[i], group=group)), nbuf, nbytes
    if op == "all_to_all":  # nbytes per rank, nbytes/n to each member (nccl-tests alltoall)
        ins = [rnd(numel) for _ in range(nbuf)]
        outs = [torch.empty(numel, device=dev) for _ in range(nbuf)]
        return (lambda i: dist.all_to_all_single(outs[i], ins[i], group=group)), nbuf, nbytes
    if op == "send_recv":  # ring shift, as nccl-tests sendrecv: send to r+1, receive from r-1
        sends = [rnd(numel) for _ in range(nbuf)]
        recvs = [torch.empty(numel, device=dev) for _ in range(nbuf)]

        def shift(i: int) -> None:
            ops = [dist.P2POp(dist.isend, sends[i], (rank + 1) % n, group),
                   dist.P2POp(dist.irecv, recvs[i], (rank - 1) % n, group)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return shift, nbuf, nbytes
    raise ValueError(f"unknown collective {op}")


def quiet_time(rounds: list[float]) -> float:
    """The second-best round: the machine when nobody intruded, seen at least twice.

    Not the minimum: one round can read fast by luck (a sample median over a few
    samples), and a point given more rounds would read systematically faster.
    The collective sweep takes extra rounds until the two best agree within 10%
    (:mod:`calibration.microbench.collectives_worker`).
    """
    return sorted(rounds)[1] if len(rounds) > 1 else rounds[0]


def human(n: float) -> str:
    """A byte count as people read it: ``512 B``, ``64 KiB``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"

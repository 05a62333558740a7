"""The eager framework's host cost per kernel on a CPU "device" (``gpu.host_overhead_us``).

On a CPU the thread that runs a kernel also runs everything PyTorch eager does around
it: the Python module calls, the dispatcher, autograd's graph recording and backward
engine, the for-loop optimizer's Python. None of that is in the bare-kernel timings
(``kernel_overhead_us`` is the intercept of a tight loop of one op), and none of it
overlaps the kernels, as a GPU's host would.

The measurement: one training step (forward, backward, AdamW) of the measured GPT
(:mod:`calibration.measured.gpt`) at a degenerate size, width 8 and 2 tokens, where
every kernel is a few microseconds, timed as the minimum over repeats; divided by the
kernels the simulator's inventory counts for that step under the ``pytorch-eager``
stack (:mod:`simulator.inventory`), less the bare per-kernel overhead. The model is
the measured runs' own code, not a fit to their step times: what is measured is a
per-kernel constant at a size where the step is nothing else.
"""

from __future__ import annotations

import time
from typing import Any

#: the degenerate measured GPT: every kernel is tiny, the step is host cost
HOST_GPT = {"layers": 4, "hidden": 8, "heads": 1, "ffn_hidden": 8, "vocab": 8, "seq_len": 2}
BATCH = 1


def step_kernels(sizes: dict[str, int] = HOST_GPT, batch: int = BATCH) -> int:
    """Kernels of one step of the measured GPT as the simulator counts them (the
    ``pytorch-eager`` stack, fp32, one micro-batch, grads set to None before it)."""
    from simulator import model as mdl
    from simulator.inventory import layer_tensors
    from simulator.scenario import ModelSpec
    from simulator.stack import load_stack

    stack = load_stack("pytorch-eager")
    spec = ModelSpec.model_validate({**sizes, "kv_heads": sizes["heads"], "activation": "gelu",
                                     "norm": "layernorm", "bias": True,
                                     "tied_embeddings": True, "position": "learned"})
    total = 0
    for pass_ in ("fwd", "bwd_input", "bwd_weight"):
        ops = (*mdl.layer_ops(spec, batch, 1, False, "fp32", pass_, 0, stack) * spec.layers,
               *mdl.embedding_ops(spec, batch, 1, False, "fp32", pass_, stack),
               *mdl.head_ops(spec, batch, 1, False, "fp32", pass_, stack))
        # the first micro-batch's grads are stolen by AccumulateGrad, not added
        total += sum(op.kernels for op in ops if op.name != "grad_accum")
    tensors = spec.layers * layer_tensors(spec, stack) + 4
    return total + mdl.optimizer_op(1.0, tensors, stack, "fp32").kernels


def measure_host_us(threads: int, kernel_overhead_us: float, repeats: int = 7,
                    steps: int = 20) -> dict[str, Any]:
    """Host microseconds per kernel of eager PyTorch on this CPU (see the module note)."""
    import torch

    from calibration.measured.gpt import GPT, GPTConfig, loss_fn, synthetic_batch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(**HOST_GPT)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = synthetic_batch(cfg, BATCH, 0)

        def step() -> None:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(5):
            step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - t0) / steps)
    finally:
        torch.set_num_threads(before)
    kernels = step_kernels()
    per_kernel = min(times) / kernels * 1e6
    return {"host_overhead_us": round(max(per_kernel - kernel_overhead_us, 0.0), 3),
            "step_s_min": min(times), "step_s_max": max(times), "kernels": kernels}

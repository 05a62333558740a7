"""A straggler on purpose: ``clustersim measure --slow-rank R --slowdown K``.

Rank R's compute takes K times as long; the other ranks and every transfer are
untouched, so the run measures what one slow GPU costs its peers (the waits of
the data-parallel reductions, the pipeline stage that everyone else waits for).
It is the measured side of the simulator's ``variability: {slow_gpus: [{ranks:
[R], compute_slowdown: K}]}`` (:mod:`simulator.spec.variability`), which multiplies
that rank's compute task durations by K.

How: after each piece of compute finishes, the rank sleeps K − 1 times as long
as it took. The pieces are the model's top-level modules (the embedding, every
transformer block, the final norm, the output layer): forward hooks time each
forward; hooks on the module's output and input tensors time each backward (from
the gradient of the output to the gradient of the input; the embedding, whose input
is token ids, has no such point, so its backward, a scatter of one micro-batch's rows,
~0.1% of a tiny-gpt step, is not slowed); the optimizer's step hooks time the step.
A sleep is taken out of any other piece's window still open (the next piece's
backward starts on the same gradient).
Tensor hooks, not ``register_full_backward_hook``: the full backward hooks wrap every
module call's inputs and outputs in extra autograd functions, which on tiny-gpt DP 2
cost ~4 ms a step of the straggler's time on top of what it slept (a run at
K = 1.0001 stepped 67.5 ms against 57.9 ms without hooks, 5.7 ms of it timed as
slept), time the simulator's straggler did not get. Sleeping rather
than repeating the work keeps the numerics and the memory unchanged, and on a
CPU process it frees the core as a slower device would. Communication threads
(gloo, DDP's bucket reductions) keep running while the main thread sleeps, as a
slow GPU's NCCL kernels would on their own stream.

What the rank slept is timed, not taken as asked: ``time.sleep`` overshoots (about
0.1 ms a call on this project's VM, with a tiny GPT's ~57 pieces a step), and a timed
piece holds whatever the main thread did inside it besides compute (DDP's bucket
launches from the autograd hooks, the thread waiting for a core), so on tiny-gpt the
straggler slept 59.5 ms a step where the simulator's 2x added 44.6 ms of compute.
Nor does a piece after a sleep run as fast as it would have: the core wakes with cold
caches (on this project's VM a tiny-gpt block's forward took 673-710 µs right after a
0.6 ms sleep against 590-609 µs back to back), a cost a slower GPU would not have but
this rank pays about 57 times a step. So the warm-up steps do not sleep and time the
pieces (from the second on: the first is cold), the timed steps time them too, and
the difference of the two medians is the wake-up cost (``slowdown_step_piece_s`` −
``slowdown_awake_piece_s``). :meth:`SlowDown.counting` records what each step slept
and its pieces' time; the measured run reports the timed steps' medians
(``slowdown_step_slept_s``, ``slowdown_step_piece_s``) and the awake steps'
(``slowdown_awake_piece_s``), and ``clustersim compare`` simulates the straggler with
the slowdown that adds exactly what it slept plus what it woke to
(:func:`calibration.measured.compare.slowdown_as_slept`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class SlowDown:
    """Sleeps ``factor − 1`` times the duration of each timed piece; counts what it slept."""

    def __init__(self, factor: float) -> None:
        if factor < 1:
            raise ValueError(f"slowdown must be >= 1 (a rank cannot be made faster); got {factor}")
        self.extra = factor - 1.0
        self.slept_s = 0.0  # as timed around each sleep
        self.asked_s = 0.0  # as asked of time.sleep
        self.piece_s = 0.0  # the pieces' own time (their windows, sleeps taken out)
        self.pieces = 0
        self.sleeping = True  # off in a counting step's awake calls: time, do not sleep
        self.step_slept_s: list[float] = []  # per call of a counting step
        self.step_piece_s: list[float] = []  # per call of a counting step
        self.awake_calls = 0  # of those, the first calls, which did not sleep
        self._starts: dict[tuple[int, str], float] = {}

    def start(self, key: tuple[int, str]) -> None:
        self._starts[key] = time.perf_counter()

    def stop(self, key: tuple[int, str]) -> None:
        begun = self._starts.pop(key, None)
        if begun is None:
            return
        took = time.perf_counter() - begun
        self.piece_s += took
        if self.extra <= 0 or not self.sleeping:
            return
        pause = self.extra * took
        asleep = time.perf_counter()
        time.sleep(pause)
        slept = time.perf_counter() - asleep
        self.slept_s += slept
        self.asked_s += pause
        self.pieces += 1
        for other in self._starts:  # a sleep is no piece's compute: not in an open window
            self._starts[other] += slept

    def counting(self, step: Callable[[], Any], awake: int = 0) -> Callable[[], Any]:
        """``step`` that also records what each call of it slept (``step_slept_s``) and its
        pieces' time (``step_piece_s``); its first ``awake`` calls do not sleep."""
        self.awake_calls = awake

        def counted() -> Any:
            self.sleeping = len(self.step_slept_s) >= awake
            slept, pieces = self.slept_s, self.piece_s
            out = step()
            self.sleeping = True
            self.step_slept_s.append(self.slept_s - slept)
            self.step_piece_s.append(self.piece_s - pieces)
            return out
        return counted

    def watch(self, module: nn.Module) -> None:
        """Time ``module``'s forward, and its backward from the gradient of its output to
        the gradient of its input, with hooks on those two tensors."""
        fwd, bwd = (id(module), "F"), (id(module), "B")

        def before(m: nn.Module, args: tuple[Any, ...]) -> None:
            self.start(fwd)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda g: self.stop(bwd))

        def after(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self.stop(fwd)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self.start(bwd))

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        key = (id(optimizer), "step")
        optimizer.register_step_pre_hook(lambda opt, a, k: self.start(key))
        optimizer.register_step_post_hook(lambda opt, a, k: self.stop(key))


def pieces(model: nn.Module) -> list[nn.Module]:
    """The top-level modules of a (stage of the) GPT whose compute is timed: the
    embedding, each block, the final norm and the head, whichever the stage has."""
    out: list[nn.Module] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            out.extend(child.children())
        elif child is not None:
            out.append(child)
        del name
    return out


def slow_down(models: Iterable[nn.Module], optimizer: torch.optim.Optimizer,
              factor: float) -> SlowDown:
    """Make this rank's compute ``factor`` times as long (see the module note)."""
    slow = SlowDown(factor)
    for model in models:
        for piece in pieces(model):
            slow.watch(piece)
    slow.watch_optimizer(optimizer)
    return slow


def report(slow: SlowDown | None, timed: int = 0) -> dict[str, Any]:
    """What the rank slept (for measured.json), or nothing when it was not slowed: in all
    (timed and asked), in how many pieces, the medians over the last ``timed`` counted
    steps (the timed ones; none when nothing was counted) of what each slept and of its
    pieces' time, and the median pieces' time of the awake calls after the first."""
    if slow is None:
        return {}
    out = {"slowdown_slept_s": slow.slept_s, "slowdown_asked_s": slow.asked_s,
           "slowdown_pieces": slow.pieces}
    steps = slow.step_slept_s[-timed:] if timed > 0 else []
    if steps:
        out["slowdown_step_slept_s"] = statistics.median(steps)
        out["slowdown_step_piece_s"] = statistics.median(slow.step_piece_s[-timed:])
    awake = slow.step_piece_s[:slow.awake_calls]
    if len(awake) > 1:
        awake = awake[1:]  # the first call is cold (first-touch allocations)
    if awake:
        out["slowdown_awake_piece_s"] = statistics.median(awake)
    return out

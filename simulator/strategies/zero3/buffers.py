"""The memory ZeRO-3 / FSDP holds beside the sharded states, and when: the gathered units
(the running one and the prefetched ones), one unsharded gradient before its
reduce-scatter, and the root unit (embedding, output layer) with the output layer's
unsharded gradient.

They do not all exist at once. The stage's peak is the larger of two moments of its
first backward (:func:`zero3_moments`), each with what the loss holds then:

- **loss**: the loss's backward, when every in-flight micro-batch's activations and
  the loss's softmax and gradient copies are held (:func:`simulator.model.memory.logits`);
  gathered are the root unit and the running unit (the last block, which FSDP2 under
  torchtitan keeps gathered after its forward for the backward to start with; every
  layer of the stage without ``reshard_after_forward``); no gradient exists yet.
- **block**: the first block's backward, the loss's tensors of this micro-batch freed
  (:func:`simulator.model.memory.logits_after_head`); gathered are the root unit, the
  running block and the ``fsdp_prefetch`` blocks prefetched after it, with the block's
  unsharded gradient before its reduce-scatter and, on the last stage, the output
  layer's unsharded gradient, made by the head's backward and reduce-scattered with the
  root unit's at the backward's end (FSDP2's root post-backward; FSDP1's root flat
  parameter).

Later blocks' backwards hold the same buffers over fewer activations, so the first one
stands for them. On a stage without the output layer the block's moment holds the
loss's and more; there the peak is always the block's.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.model import moe
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import zero3_blocks
from simulator.model.memory import logits, logits_after_head, rank_params
from simulator.model.transformer import embedding_params, head_params, layer_params
from simulator.spec.placement import (
    embedding_copy_params,
    holds_embedding,
    holds_head,
    stage_layer_count,
)
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.deferred import deferred

#: the moments of :func:`zero3_moments`, in words (``clustersim memory``'s buffers item)
MOMENTS = {"loss": "the loss's backward (the root and the running unit gathered)",
           "block": "the first block's backward (running and prefetched units, the "
                    "unsharded gradients)"}


def moment_words(scenario: Scenario, stage: int) -> str:
    """The peak's moment of ``stage`` in words (:data:`MOMENTS`), and under deferred
    reductions what every moment holds beside it."""
    name = zero3_peak(scenario, stage).name
    if not deferred(scenario):
        return MOMENTS[name]
    held = ", their gradients accumulated unsharded" \
        if accumulated_grads(scenario, stage) else ""
    return MOMENTS[name].split(" (")[0] + " (torch.distributed.pipelining: every unit of " \
        f"the stage gathered{held})"


@dataclass(frozen=True)
class Moment:
    """What one GPU of a stage holds at one moment of its backward beside the model
    states and activations: ZeRO-3's buffers and the loss's tensors, in bytes."""

    name: str
    buffers: float
    logits: float

    @property
    def total(self) -> float:
        return self.buffers + self.logits


def zero3_root_bytes(scenario: Scenario, stage: int) -> tuple[float, float]:
    """ZeRO-3 on one GPU of pipeline ``stage``: bytes of the root unit's gathered
    parameters (the embedding on the first stage, the final norm, output layer and a
    tied embedding's copy on the last) and of the output layer's unsharded gradient
    (last stage: the head's parameters, or the shared embedding's when tied)."""
    spec, par = scenario.model, scenario.parallel
    dt = dtype_bytes(scenario.training.dtype) / par.tp
    tied = spec.vocab * spec.hidden if spec.tied_embeddings else 0
    gathered = embedding_params(spec) if holds_embedding(par, stage) else 0.0
    grad = 0.0
    if holds_head(par, stage):
        copy = embedding_copy_params(spec, par)
        gathered += head_params(spec) + copy
        grad = head_params(spec) + max(tied, copy)
    return gathered * dt, grad * dt


def zero3_layer_bytes(scenario: Scenario) -> float:
    """One layer's 16-bit parameters on one rank (the largest layer's, MoE layers with
    their routed experts split over expert_tp · ep): a gathered layer, or its unsharded
    gradient."""
    spec = scenario.model
    return max(rank_params(scenario, layer_params(spec, i) - moe.expert_params(spec, i),
                           moe.expert_params(spec, i)) for i, _ in moe.layer_kinds(spec)) \
        * dtype_bytes(scenario.training.dtype)


def gathered_layers(scenario: Scenario, stage: int, units: int) -> float:
    """Layers' worth of gathered parameters while ``units`` units are gathered (the
    running one and those prefetched after it): by modules, as DeepSpeed gathers them
    (Zero3Pass: attention and MLP blocks alternate), the largest ``units`` consecutive
    blocks; every layer of the stage without ``reshard_after_forward``."""
    spec, par = scenario.model, scenario.parallel
    if not par.reshard_after_forward or deferred(scenario):  # every layer stays gathered
        return float(stage_layer_count(spec.layers, par, stage, spec.mtp_layers))
    if scenario.stack.zero3_unit == "module" and not spec.is_moe:
        blocks = zero3_blocks(spec, scenario.stack, par.tp, 1.0)
        seq = [sum(blocks["attn"]), sum(blocks["mlp"])]
        return max(sum(seq[(start + i) % 2] for i in range(units)) for start in (0, 1))
    return float(units)


def accumulated_grads(scenario: Scenario, stage: int) -> float:
    """Bytes of the unsharded gradients a stage accumulates under ``torch.distributed.
    pipelining`` (:mod:`simulator.strategies.zero3.deferred`): every unit's, the root's
    included, in the reduce dtype, held from the first backward to the reductions after
    the last, so by every later micro-batch's backward; none with one micro-batch (its
    backward's moments precede them) or where the reductions are not deferred."""
    if not deferred(scenario) or scenario.microbatches == 1:
        return 0.0
    spec, par = scenario.model, scenario.parallel
    dt = dtype_bytes(scenario.training.dtype)
    layers = stage_layer_count(spec.layers, par, stage, spec.mtp_layers)
    params = zero3_layer_bytes(scenario) * layers + zero3_root_bytes(scenario, stage)[0]
    return params / dt * scenario.stack.reduce_bytes(dt)


def zero3_moments(scenario: Scenario, stage: int) -> tuple[Moment, Moment]:
    """The two moments of ``stage``'s first backward whose buffers and loss tensors
    coexist (the module docstring): the loss's backward and the first block's."""
    par = scenario.parallel
    ahead = par.overlap.zero3_prefetch and scenario.hardware.gpu.comm_overlaps_compute
    prefetched = par.fsdp_prefetch if ahead else 0
    layer = zero3_layer_bytes(scenario)
    root, head_grad = zero3_root_bytes(scenario, stage)
    held = accumulated_grads(scenario, stage)
    loss = Moment("loss", root + layer * gathered_layers(scenario, stage, 1) + held,
                  logits(scenario, stage))
    # the running block and those prefetched, its unsharded gradient, the root unit's
    block = Moment("block", layer * gathered_layers(scenario, stage, 1 + prefetched) + layer
                   + (root + head_grad) + held, logits_after_head(scenario, stage))
    return loss, block


def zero3_peak(scenario: Scenario, stage: int) -> Moment:
    """The moment of :func:`zero3_moments` that holds the most (the block's on a tie)."""
    loss, block = zero3_moments(scenario, stage)
    return loss if loss.total > block.total else block


def zero3_buffers(scenario: Scenario, stage: int) -> float:
    """ZeRO-3's communication buffers on one GPU of ``stage`` at its peak
    (:func:`zero3_peak`)."""
    return zero3_peak(scenario, stage).buffers

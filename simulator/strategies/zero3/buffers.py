"""The memory ZeRO-3 / FSDP holds beside the sharded states: the gathered units (the
running one and the prefetched ones), one unsharded gradient before its reduce-scatter,
and the root unit (embedding, output layer) with the output layer's unsharded gradient.
"""

from __future__ import annotations

from simulator.model import moe
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import zero3_blocks
from simulator.model.memory import rank_params
from simulator.model.transformer import embedding_params, head_params, layer_params
from simulator.spec.placement import holds_embedding, holds_head, stage_layer_count, tied_copy
from simulator.spec.scenario import Scenario


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
        copy = spec.vocab * spec.hidden if spec.head_needs_embedding and tied_copy(par) else 0
        gathered += head_params(spec) + copy
        grad = head_params(spec) + max(tied, copy)
    return gathered * dt, grad * dt


def zero3_buffers(scenario: Scenario, stage: int) -> float:
    """ZeRO-3's communication buffers on one GPU of ``stage``: the gathered 16-bit
    parameters of the running unit and the prefetched ones (by modules, as DeepSpeed
    gathers them: the running block and the ``fsdp_prefetch`` blocks after it), one
    layer's unsharded gradient before its reduce-scatter, and the root unit
    (:func:`zero3_root_bytes`)."""
    par = scenario.parallel
    spec = scenario.model
    layer = max(rank_params(scenario, layer_params(spec, i) - moe.expert_params(spec, i),
                             moe.expert_params(spec, i)) for i, _ in moe.layer_kinds(spec)) \
        * dtype_bytes(scenario.training.dtype)
    ahead = par.overlap.zero3_prefetch and scenario.hardware.gpu.comm_overlaps_compute
    if not par.reshard_after_forward:  # every layer of the stage stays gathered
        gathered: float = stage_layer_count(spec.layers, par, stage, spec.mtp_layers)
    elif scenario.stack.zero3_unit == "module" and not spec.is_moe:
        # DeepSpeed's modules, gathered by blocks as the engine runs them
        # (Zero3Pass): the running block and the fsdp_prefetch
        # blocks after it (attention and MLP blocks alternate), without prefetch the
        # running block alone; in layers
        blocks = zero3_blocks(spec, scenario.stack, par.tp, 1.0)
        seq = [sum(blocks["attn"]), sum(blocks["mlp"])]
        n = 1 + (par.fsdp_prefetch if ahead else 0)
        gathered = max(sum(seq[(start + i) % 2] for i in range(n)) for start in (0, 1))
    else:  # the running layer plus the prefetched ones
        gathered = 1 + (par.fsdp_prefetch if ahead else 0)
    root = sum(zero3_root_bytes(scenario, stage))
    return layer * gathered + layer + root  # gathered params + one unsharded grad + root

"""Sizes of the model's communication payloads: one TP collective of a layer or of the
model's ends, and one pipeline send (re-exported by :mod:`simulator.model.transformer`)."""

from __future__ import annotations

from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.tensor_parallel import EndPayload
from simulator.spec.model_spec import ModelSpec


def tp_comm_bytes_per_layer(spec: ModelSpec, micro_batch: int, dtype: str = "bf16") -> float:
    """Size of one TP all-reduce (b·s·h): two per layer forward, two backward."""
    return float(micro_batch * spec.seq_len * spec.hidden * dtype_bytes(dtype))


def tp_end_bytes(spec: ModelSpec, micro_batch: int, dtype: str) -> dict[EndPayload, float]:
    """Bytes of one TP collective at the model's ends by what it carries
    (:func:`simulator.model.inventory.tensor_parallel.tp_end_collectives`): the b·s·h activation,
    the b·s·V
    logits, the cross-entropy's fp32 value per token, a multi-token prediction module's
    b·s·2h concatenation."""
    tokens = micro_batch * spec.seq_len
    activation = tp_comm_bytes_per_layer(spec, micro_batch, dtype)
    return {"activation": activation,
            "logits": float(tokens * spec.vocab * dtype_bytes(dtype)), "loss": 4.0 * tokens,
            "mtp_input": 2 * activation}


def pp_activation_bytes(spec: ModelSpec, micro_batch: int, dtype: str = "bf16") -> float:
    """One stage-boundary send of activations (or of their gradient): b·s·h."""
    return float(micro_batch * spec.seq_len * spec.hidden * dtype_bytes(dtype))

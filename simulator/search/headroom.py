"""The planner's memory headroom: what a layout must leave free on every GPU.

The memory model (:mod:`simulator.analysis.memory`) counts the tensors and the device's
own terms (:mod:`simulator.model.device_memory`: context, workspaces, NCCL buffers, the
caching allocator's rounding). What it cannot count in closed form is fragmentation:
activations freed out of order leave cached blocks that a later, larger request cannot
use, so ``torch.cuda.memory_reserved`` runs above ``memory_allocated``. The planner
keeps a headroom for it: no layout it returns needs more than capacity − headroom.

By default 5 % of the GPU's memory: the margin Megatron-LM's own estimate adds for
temporaries beyond the tensors it counts (``megatron/training/theoretical_memory_usage.py``,
``overhead_factor = 1.05``). ``--headroom`` sets a share (``8%``) or bytes (``4GB``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from simulator.errors import Problem, UserError


@dataclass(frozen=True)
class Headroom:
    """A share of the GPU's memory and a fixed amount, kept free together."""

    fraction: float = 0.0
    GB: float = 0.0

    def bytes(self, capacity: float) -> float:
        """The bytes kept free on a GPU of ``capacity`` bytes."""
        return self.fraction * capacity + self.GB * 1e9

    def __str__(self) -> str:
        parts = ([f"{self.fraction:.0%}"] if self.fraction else []) + \
            ([f"{self.GB:g} GB"] if self.GB else [])
        return " + ".join(parts) or "none"


#: Megatron-LM's overhead_factor = 1.05 (module note)
DEFAULT_HEADROOM = Headroom(fraction=0.05)

_FORM = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|GB)?\s*$", re.IGNORECASE)


def parse_headroom(text: str, flag: str = "--headroom") -> Headroom:
    """``5%`` (a share of the GPU's memory), ``4GB`` or ``4`` (1e9 bytes), ``0``."""
    m = _FORM.match(text)
    if m is None:
        raise UserError([Problem(flag, text, "give a share like 5% or an amount like 4GB")])
    value, unit = float(m.group(1)), (m.group(2) or "GB").upper()
    if unit == "%":
        if value >= 100:
            raise UserError([Problem(flag, text, "a share must be below 100%")])
        return Headroom(fraction=value / 100)
    return Headroom(GB=value)

"""A toy strategy in one file: the extension point as a new parallelism uses it.

``gradnorm``: before the optimizer step every rank all-reduces the partial sums of the
global gradient norm over its data-parallel group (what clipping by the norm exchanges
across replicas), ``bytes`` of them, on the compute stream, and keeps a buffer of that
size. It owns its own scenario section (``strategies.gradnorm``), one rule, its pass,
its communication kind (so its own accounting categories), its closed-form term, its
memory term and a search dimension. Registering it is one line (``STRATEGIES``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from simulator.builder.context import Context, Pass
from simulator.errors import Problem
from simulator.spec.base import Frozen
from simulator.spec.scenario import Scenario
from simulator.strategies.base import AnalyticView, Dimension, Strategy
from simulator.strategies.timing import collective_time


class GradNormOptions(Frozen):
    enabled: bool = False  # exchange the norm's partial sums every step
    bytes: int = Field(default=4, ge=1, le=1 << 20)  # fp32 partial sums, 4 bytes each


class GradNormPass(Pass):
    def __init__(self, ctx: Context, nbytes: int) -> None:
        super().__init__(ctx)
        self.nbytes = nbytes

    def sync_end(self, rank: int) -> None:
        """After the last backward, before the optimizer step (which the data pass adds
        next on the compute stream)."""
        self.ctx.collective(rank, "compute", "all_reduce", "gradnorm",
                            self.ctx.layout.dp_group(rank), float(self.nbytes),
                            "gradnorm.all_reduce")


class GradNorm(Strategy):
    name = "gradnorm"
    kinds = ("gradnorm",)
    options = GradNormOptions

    def active(self, s: Scenario) -> bool:
        return bool(self.settings(s).enabled) and s.parallel.dp > 1

    def problems(self, s: Scenario) -> list[Problem]:
        o = self.settings(s)
        if o.bytes % 4:
            return [Problem("strategies.gradnorm.bytes", o.bytes, "the partial sums are "
                            "fp32: use a multiple of 4")]
        return []

    def make_pass(self, ctx: Context) -> Pass | None:
        return GradNormPass(ctx, self.settings(ctx.s).bytes)

    def analytic_terms(self, view: AnalyticView) -> dict[str, float]:
        if not self.active(view.s):
            return {}
        group = view.layout.dp_group(0)
        nbytes = float(self.settings(view.s).bytes)
        return {"gradnorm_transfer": collective_time(view.s, view.layout, "all_reduce",
                                                     nbytes, group, view.hw)}

    def memory_terms(self, s: Scenario, stage: int) -> dict[str, float]:
        return {"comm_buffers": float(self.settings(s).bytes)} if self.active(s) else {}

    def dimensions(self) -> tuple[Dimension, ...]:
        return (Dimension(("gradnorm",), ("strategies.gradnorm.enabled",), 110, _choices),)


def _choices(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> tuple[tuple[bool], ...]:
    return ((False,), (True,))


GRADNORM = GradNorm()

"""The summary lines of a run's extras beside its step (many steps, the uncertainty
of a calibrated profile's terms), after :func:`simulator.analysis.report.summary_lines`
(apart from it: the steps module itself reads the report)."""

from __future__ import annotations

from typing import Any


def extras_lines(results: dict[str, Any]) -> list[str]:
    """The summaries of a run's extras beside the step: many steps, uncertainty."""
    lines: list[str] = []
    if "steps" in results:
        from simulator.analysis.steps import summary_lines as steps_lines

        lines += steps_lines(results["steps"])
    if "uncertainty" in results:
        from simulator.analysis.uncertainty import summary_lines as uncertainty_lines

        lines += uncertainty_lines(results["uncertainty"])
    return lines

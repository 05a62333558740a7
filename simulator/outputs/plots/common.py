"""What every figure shares: the colours of span kinds and categories, the time unit
of an axis, and saving a figure atomically through the Agg canvas (pyplot is never
imported, so no figure outlives its function and concurrent runs share no state).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from simulator.outputs.trace_export import atomic_output

#: Bar colour of each span kind (Tableau 10), in legend order.
KIND_COLOURS: Mapping[str, str] = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "weight_grad": "#E45756",
    "recompute": "#72B7B2",
    "tp": "#B279A2",
    "pp": "#54A24B",
    "dp": "#EECA3B",
    "zero": "#9D755D",
    "optimizer": "#BAB0AC",
    "offload": "#FF9DA6",
    "embedding_tie": "#8CD17D",
    "wait": "#D9D9D9",  # a collective's member waiting for its peers
}


OTHER_COLOUR = "#79706E"

#: The accounting category of a compute span's kind (a backward span's weight-gradient
#: share, ``weight_s``, is ``backward_weight``; a communication kind's span is its
#: ``<kind>_transfer``, the peer-wait before ``comm_start`` its ``<kind>_wait``).
COMPUTE_SPAN_CATEGORY: Mapping[str, str] = {
    "forward": "forward", "backward": "backward_input", "weight_grad": "backward_weight",
    "recompute": "recompute", "optimizer": "optimizer"}


BUBBLE_COLOUR = "#E6E6E6"


CAPACITY_COLOUR = "#C00000"


PATH_COLOUR = "#D62728"


GB = 1e9  # decimal gigabytes, as the CLI and README


DPI = 120


def category_style(category: str) -> dict[str, Any]:
    """Face colour, hatch and alpha of an accounting category, the same in every figure:
    compute in its kind's colour (backward input and backward weight apart), transfers
    solid and peer-waits hatched in their communication kind's, idle in greys."""
    kind, _, part = category.rpartition("_")
    if kind and part in ("transfer", "wait"):
        colour = KIND_COLOURS.get(kind, OTHER_COLOUR)
        return {"color": colour, "hatch": ".." if part == "wait" else None,
                "alpha": 0.55 if part == "wait" else 1.0}
    styles = {"forward": (KIND_COLOURS["forward"], None),
              "backward_input": (KIND_COLOURS["backward"], None),
              "backward_weight": (KIND_COLOURS["weight_grad"], None),
              "recompute": (KIND_COLOURS["recompute"], None),
              "optimizer": (KIND_COLOURS["optimizer"], None),
              "pipeline_bubble": (BUBBLE_COLOUR, "//"),
              "imbalance_idle": ("#C9C9C9", "xx"),
              "tail": ("#F7F7F7", "--")}
    colour, hatch = styles.get(category, (KIND_COLOURS.get(category, OTHER_COLOUR), None))
    return {"color": colour, "hatch": hatch, "alpha": 1.0}


def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Render ``fig`` to PNG at ``path`` via a temporary file in the same directory."""
    FigureCanvasAgg(fig)
    engine = fig.get_layout_engine()
    if engine is not None:  # lay out once now; savefig would otherwise draw everything twice
        engine.execute(fig)
        fig.set_layout_engine("none")
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return Path(path)


def time_unit(t_max: float) -> tuple[float, str]:
    """Scale factor from seconds and the axis unit for a time span of ``t_max`` s."""
    if t_max < 2e-3:
        return 1e6, "µs"
    if t_max < 2.0:
        return 1e3, "ms"
    return 1.0, "s"


def format_seconds(t: float) -> str:
    """``t`` with three significant digits in s, ms or µs (never "1.08e+03 ms")."""
    if t >= 1.0:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def scenario_header(results: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any]]:
    """The scenario's name and its ``parallel`` section (empty when absent)."""
    scenario = (results or {}).get("scenario") or {}
    parallel = scenario.get("parallel") or {}
    return str(scenario.get("name", "")), parallel


def text_colour(face: str) -> str:
    r, g, b = to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def path_ranks(results: Mapping[str, Any]) -> dict[int, float]:
    """The ranks the critical path visits, with its seconds on each."""
    path = results.get("critical_path")
    out: dict[int, float] = {}
    for seg in path if isinstance(path, list) else ():
        if isinstance(seg, Mapping) and "rank" in seg:
            r = int(seg["rank"])
            out[r] = out.get(r, 0.0) + float(seg.get("end", 0.0)) - float(seg.get("start", 0.0))
    return out


def drawn_ranks(stage_ranks: list[int], results: Mapping[str, Any]) -> list[int]:
    """The ranks the timeline needs: one per stage, and those the critical path visits
    (it is drawn on their stage's row)."""
    return sorted(set(stage_ranks) | set(path_ranks(results)))

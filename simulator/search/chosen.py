"""The planner's choice as a scenario file that ``clustersim run`` takes unchanged.

The file is written the way a person would: the plan's own model, cluster, stack and
``--set`` sections as given (a preset stays a preset), the chosen layout's parallel
and training settings, the engine (folded) as the plan simulated it. Before writing,
the file is read back through the scenario loader and compared with the scenario the
engine ran, field by field; if the compact form would not reproduce it exactly, the
fully resolved scenario is written instead. Either way ``run`` on the file gives the
plan's step time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from simulator.errors import Problem, UserError
from simulator.outputs.trace_export import atomic_output
from simulator.search.candidates import base_data
from simulator.search.plan import Plan, layout_label
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario


def _figures(s: Scenario) -> dict[str, Any]:
    """What decides the simulation: everything but the name and description."""
    out = s.to_dict()
    out.pop("name", None)
    out.pop("description", None)
    return out


def scenario_text(plan: Plan, path: Path | None = None) -> str:
    """The chosen layout as scenario YAML, with a header saying where it came from (and
    how to run it, when its ``path`` is given)."""
    s = plan.chosen_scenario
    if s is None or plan.chosen is None:
        raise UserError([Problem("--write-scenario", "", "the plan chose no layout (nothing "
                                 "fits, or --top 0); there is nothing to write")])
    row = plan.table.loc[plan.chosen]
    data = {"description": f"chosen by clustersim plan: {layout_label(row)}; "
                           f"{row['engine_step_time_s']:.4g} s a step (engine, folded)",
            **base_data(plan.request)}
    data["name"] = f"{data['name']}-chosen"
    data = {"name": data.pop("name"), **data}
    data["parallel"] = s.parallel.model_dump(mode="json", exclude_unset=True)
    data["training"] = s.training.model_dump(mode="json", exclude_unset=True)
    if _figures(scenario_from_dict(data)) != _figures(s):
        data = {**s.to_dict(), "name": data["name"], "description": data["description"]}
    header = (f"# The layout `clustersim plan` chose for {plan.request.model_name} on "
              f"{plan.request.gpus:,} GPUs of {plan.request.system}.\n"
              f"# Run it: clustersim run {path or 'FILE'}\n")
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def write_scenario(plan: Plan, path: Path) -> Path:
    """Write :func:`scenario_text` to ``path`` atomically."""
    text = scenario_text(plan, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError([Problem("--write-scenario", str(path), f"cannot be written "
                                 f"({exc.strerror or exc}); choose another path")]) from None
    return path

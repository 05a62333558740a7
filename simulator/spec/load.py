"""How a file or a mapping becomes a :class:`~simulator.spec.scenario.Scenario`:
read it bounded (:mod:`simulator.loading`), apply ``--set key.path=value`` overrides,
validate every section strictly and then the rules across them
(:func:`simulator.spec.rules.consistency_problems`), and turn every problem into one
line naming the field, the value and the fix: every problem, not just the first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from simulator.errors import Problem, ScenarioError
from simulator.loading import MAX_DEPTH, parse_override, read_yaml
from simulator.spec.problems import problem_of
from simulator.spec.rules import consistency_problems
from simulator.spec.scenario import Scenario


def apply_overrides(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings (value parsed as YAML) to a nested dict copy. A
    plain name where the path goes deeper is a preset's name, as ``stack: torchtitan``
    means ``{preset: torchtitan}``: ``--set stack.optimizer=fused`` overrides a field of
    that preset (not of the default stack)."""
    out: dict[str, Any] = _deep_copy(data)
    problems: list[Problem] = []
    for text in assignments:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            problems.append(Problem("--set", text, "expected key.path=value, e.g. parallel.tp=4"))
            continue
        parts = key.strip().split(".")
        if len(parts) > MAX_DEPTH or not all(parts):
            problems.append(Problem("--set", text[:80], f"the key needs 1 to {MAX_DEPTH} "
                                    "non-empty dotted parts, e.g. parallel.tp=4"))
            continue
        value = parse_override(raw, f"--set {key.strip()}")
        node = out
        for part in parts[:-1]:
            current = node.get(part)
            if isinstance(current, str):
                node[part] = {"preset": current}
            elif not isinstance(current, dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise ScenarioError(problems)
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read, override, resolve and validate a scenario file."""
    path = Path(path)
    data = read_yaml(path, "scenario")
    if not isinstance(data, dict):
        raise ScenarioError([Problem("scenario", str(path), "the file must be a YAML mapping "
                                     "with keys name, model, cluster, parallel, training")])
    data = apply_overrides(data, overrides or [])
    cluster = data.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("system"), str):
        system = cluster["system"]
        candidate = (path.parent / system)
        if system.endswith((".yaml", ".yml")) and not Path(system).is_absolute() \
                and _exists(candidate):
            cluster["system"] = str(candidate.resolve())
    return scenario_from_dict(data)


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; a name the file system refuses (too long) does not."""
    try:
        return path.exists()
    except OSError:
        return False


def scenario_from_dict(data: Any) -> Scenario:
    """Validate a mapping into a Scenario, or raise ScenarioError listing every problem."""
    if not isinstance(data, dict):
        raise ScenarioError([Problem("scenario", type(data).__name__, "must be a mapping")])
    try:
        scenario = Scenario.model_validate(data, strict=True)
    except ValidationError as exc:
        raise ScenarioError([problem_of(err) for err in exc.errors()]) from None
    problems = consistency_problems(scenario)  # the sections are valid: now across them
    if problems:
        raise ScenarioError(problems)
    return scenario



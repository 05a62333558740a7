"""Every bundled scenario's figures, pinned: a refactor must leave them bit-identical.

For each file under ``scenarios/`` this records the engine's step time, its
breakdown and peak memory, the analytic estimate's step time, a hash of the whole
engine and analytic results (the results.json contract, less the wall-clock time
the simulation took) and the workload's hash (:func:`test_workload_golden.digest`,
every field the engine reads). The figures are stored with ``repr`` (exact);
they are compared to 1e-12 relative, and the hashes see floats with 12
significant digits, so that a last-bit difference of a platform's libm cannot
fail the test while any change of the model can.

A deliberate change of the model updates the file:
``python tests/test_golden_scenarios.py`` rewrites ``tests/data/golden_scenarios.json``
(``--check`` compares instead, exactly, and prints what moved).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from test_workload_golden import digest

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.spec.load import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "data" / "golden_scenarios.json"
VOLATILE = {"sim_wall_s", "sim_events"}  # how long the simulation took, and its events


def _canon(x: Any) -> Any:
    if isinstance(x, float):
        return f"{x:.12g}"
    if isinstance(x, dict):
        return {k: _canon(v) for k, v in sorted(x.items()) if k not in VOLATILE}
    if isinstance(x, list | tuple):
        return [_canon(v) for v in x]
    return x


def _hash(results: dict[str, Any]) -> str:
    text = json.dumps(_canon(results), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def figures(path: Path) -> dict[str, Any]:
    """What the golden file holds for one scenario."""
    s = load_scenario(path)
    engine, _ = simulate_scenario(s, method="engine")
    analytic, _ = simulate_scenario(s, method="analytic")
    workload = build_workload(s, fidelity=s.simulation.fidelity)
    return {
        "step_time_s": engine["step_time_s"],
        "step_breakdown_s": engine["step_breakdown_s"],
        "memory_peak_bytes": engine["memory_peak_bytes"],
        "analytic_step_time_s": analytic["step_time_s"],
        "engine_hash": _hash(engine),
        "analytic_hash": _hash(analytic),
        "workload": [digest(workload), len(workload.tasks)],
    }


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _golden() -> dict[str, Any]:
    return dict(json.loads(GOLDEN.read_text()))


def test_every_bundled_scenario_is_pinned() -> None:
    assert sorted(_golden()) == sorted(p.stem for p in SCENARIOS)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_figures_unchanged(path: Path) -> None:
    want = _golden()[path.stem]
    got = json.loads(json.dumps(figures(path)))  # as stored: tuples become lists
    moved = {k: (want[k], got[k]) for k in want if not _close(want[k], got[k])}
    assert moved == {}


def test_the_hash_sees_a_changed_figure() -> None:
    results = {"step_time_s": 1.0, "memory": [{"stage": 0, "weights": 2.0}], "sim_wall_s": 3.0}
    before = _hash(results)
    assert _hash({**results, "sim_wall_s": 4.0}) == before
    assert _hash({**results, "memory": [{"stage": 0, "weights": 2.0 * (1 + 1e-9)}]}) != before


if __name__ == "__main__":
    table = {p.stem: figures(p) for p in SCENARIOS}
    if "--check" in sys.argv:
        old = _golden()
        bad = {name: [k for k in row if row[k] != old.get(name, {}).get(k)]
               for name, row in json.loads(json.dumps(table)).items()}
        bad = {k: v for k, v in bad.items() if v}
        print(json.dumps(bad, indent=1) if bad else "all bit-identical")
        sys.exit(1 if bad else 0)
    GOLDEN.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}: {len(table)} scenarios")

"""The machine at the end of a validation: the calibration's two-rank terms measured again.

A validation simulates every row from one calibration, taken before the first row. On a
shared VM the machine it describes does not stay put: on the project's 2-vCPU VM the
rank spread (:mod:`calibration.microbench.terms.rank_spread`) read 0.056 in a calibration, 0.128
in the compute segments of a TP run a few minutes later and 0.19 forty minutes after it,
which moves a TP step by several percent whatever the model does. So after its last row
``clustersim validation`` measures the terms it can measure in one short torchrun launch
again — the two-rank terms of the collectives' launch (interference, the collective and
send sync costs, the redistributions' host time, the rank spread; no collective sweep) —
with the calibration's own microbenchmarks, and the table says each one beside the
profile's figure. Nothing is simulated from them: they say how far the machine moved
while the rows ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: (the profile's key under ``gpu``, its intra-node entry where it is per link class,
#: ``funcol_host.KIND`` the intercept of that kind's line; label; unit; format)
TERMS: tuple[tuple[str, str, str, str], ...] = (
    ("rank_spread", "rank spread", "", "{:.3f}"),
    ("collective_sync_us", "collective sync", " us", "{:.0f}"),
    ("funcol_host.all_reduce", "funcol host all-reduce", " us", "{:.0f}"),
    ("funcol_host.all_gather", "funcol host all-gather", " us", "{:.0f}"),
    ("funcol_host.reduce_scatter", "funcol host reduce-scatter", " us", "{:.0f}"),
    ("send_sync_us", "send sync", " us", "{:.0f}"),
    ("interference", "interference", "x", "{:.2f}"),
)


def figures(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """The terms fitted from a launch's records as the profile keeps them (µs for the
    sync costs, intra-node), None for a term without a successful record."""
    from calibration.microbench.terms import (
        collective_sync,
        funcol_host,
        interference,
        rank_spread,
        send_sync,
    )

    def of(kind: str) -> list[dict[str, Any]]:
        return [r for r in records if r.get("kind") == kind]

    spread, _ = rank_spread.fit(of("rank_spread"))
    factor, _ = interference.fit(of("interference"))
    out: dict[str, float | None] = {"rank_spread": spread,
                                    "interference": factor.get("intra_node")}
    for key, term in (("collective_sync_us", collective_sync), ("send_sync_us", send_sync)):
        seconds = term.fit(of(term.KIND))[0].get("intra_node")
        out[key] = None if seconds is None else seconds * 1e6
    lines, _ = funcol_host.fit(of("funcol_host"))
    for kind in funcol_host.KINDS:
        out[f"funcol_host.{kind}"] = lines[kind][0] * 1e6 if kind in lines else None
    return out


def calibrated(profile: dict[str, Any]) -> dict[str, float | None]:
    """The same terms as the profile states them (None where it has none)."""
    gpu = profile.get("gpu") or {}
    out: dict[str, float | None] = {}
    for key, *_ in TERMS:
        if key.startswith("funcol_host."):
            value = ((gpu.get("funcol_host") or {}).get(key.split(".")[1]) or {}).get("us")
        else:
            value = gpu.get(key)
            value = value.get("intra_node") if isinstance(value, dict) else value
        out[key] = float(value) if isinstance(value, (int, float)) else None
    return out


def sentence(now: dict[str, float | None], then: dict[str, float | None]) -> str:
    """One line: each term measured again, the calibration's figure beside it; empty when
    nothing was measured again."""
    parts = []
    for key, label, unit, fmt in TERMS:
        value = now.get(key)
        if value is None:
            continue
        before = then.get(key)
        was = "none" if before is None else fmt.format(before) + unit
        parts.append(f"{label} {fmt.format(value)}{unit} ({was})")
    if not parts:
        return ""
    return ("The machine after the last row, the calibration's two-rank terms measured "
            "again (the profile's figure in brackets; nothing is simulated from these): "
            + ", ".join(parts) + ".")


def remeasure(device: str, threads: int, out: Path, timeout_s: float) -> dict[str, float | None]:
    """Measure the two-rank terms once more in a torchrun launch of two ranks (a fresh
    results file ``recheck.results.jsonl`` under ``out``) and fit them."""
    from calibration.microbench.bench_collectives import run_collectives
    from calibration.microbench.bench_results import ResultsStore
    from calibration.microbench.bench_timing import Device, budget_for

    path = out / "recheck.results.jsonl"
    path.unlink(missing_ok=True)  # the machine now, not a resumed earlier recheck
    store = ResultsStore(path)
    run_collectives(Device(device, threads), 2, budget_for(device, "quick"), store, timeout_s,
                    ops=(), terms=True)
    return figures(store.records())

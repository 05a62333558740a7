"""Each published row simulated and set beside its measurement, in the row's own unit.

A row becomes a scenario (:mod:`simulator.published.mapping`), is validated by the
scenario's own rules, simulated (the closed form by default, or the engine, folded) and
its figure read in the row's unit (:data:`UNITS`); the error is simulated / measured − 1,
so a positive error reads the run faster than it was. A row that cannot be expressed,
that the scenario rules refuse or that has no workload yet keeps its reason instead.
Errors are then grouped by regime (:data:`REGIMES`): GPU, model size, sequence length,
GPU count, tokens per micro-batch, checkpointing and dtype; each row also says what share of
its simulated step is exposed communication (``exposed_comm``) and, asked for, what share
scales with each cost class (:mod:`simulator.published.classes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import pandas as pd

from simulator.errors import UserError
from simulator.model.transformer import param_count
from simulator.published.classes import SHARE_COLUMNS, step_shares
from simulator.published.mapping import Unexpressed, replicas, scenario_data
from simulator.published.rows import Row
from simulator.spec.rules import not_yet_simulated

#: the row's unit (lower case) -> its figure from the simulation's results and the row
UNITS: dict[str, Callable[[dict[str, Any], Row], float]] = {
    "tokens/s/gpu": lambda r, row: r["tokens_per_s"] / row.gpus,
    "tokens/s": lambda r, row: r["tokens_per_s"],
    "seq/s": lambda r, row: r["tokens_per_s"] / row.seq_len,
    "s/step": lambda r, row: r["step_time_s"],
    "step_time_s": lambda r, row: r["step_time_s"],
    "mfu": lambda r, row: r["mfu"],
    "peak_memory_gb": lambda r, row: r["memory_peak_bytes"] / 1e9,
}
COLUMNS = ("name", "gpu", "gpus", "model", "params_B", "seq_len", "micro_batch_tokens",
           "replica_sequences", "sharding", "recompute", "dtype", "attention", "head_dim",
           "unit", "measured", "simulated", "error", "exposed_comm", "fits", "reason")
#: regime -> how a row's table entry falls into it
REGIMES: dict[str, Callable[[pd.Series], str]] = {
    "gpu": lambda r: str(r["gpu"]).split(" (")[0],
    "model size": lambda r: _bucket(r["params_B"], (1, 10, 100), "B params"),
    "sequence length": lambda r: _bucket(r["seq_len"], (2048, 8192, 32768), " tokens"),
    "GPUs": lambda r: _bucket(r["gpus"], (8, 64, 512), " GPUs"),
    # the work a micro-batch gives each GPU against what a step does per micro-batch
    # whatever its size (FSDP's gathers and reductions, launches, the optimizer's share)
    "tokens per micro-batch": lambda r: _bucket(r["micro_batch_tokens"], (4096, 16384, 65536),
                                                " tokens"),
    "checkpointing": lambda r: str(r["recompute"]),
    "dtype": lambda r: str(r["dtype"]),
}


def kernel_group(r: pd.Series) -> str:
    """A row's GPU, attention kernel and head dimension: the group whose rows the split
    into attention and the rest tells apart (:func:`~simulator.published.classes.fit_split`)."""
    return f"{REGIMES['gpu'](r)} · {r['attention']} · head dim {r['head_dim']:.0f}"


#: the column whose values order a regime's groups (by name otherwise)
_ORDER = {"model size": "params_B", "sequence length": "seq_len", "GPUs": "gpus",
          "tokens per micro-batch": "micro_batch_tokens"}


def _bucket(value: float, edges: Sequence[float], unit: str) -> str:
    lo = 0.0
    for edge in edges:
        if value <= edge:
            return f"{lo:g}-{edge:g}{unit}" if lo else f"<={edge:g}{unit}"
        lo = edge
    return f">{lo:g}{unit}"


def _replica_sequences(row: Row) -> float:
    """Sequences a data-parallel replica runs a step (micro-batch × accumulation): what a
    weak-scaling series keeps (:mod:`simulator.published.scaling`)."""
    return row.global_batch / max(replicas(row), 1)


def compare_row(row: Row, method: str, by_class: bool = False) -> dict[str, Any]:
    """One row's table entry (module level: picklable for process and Dask workers); with
    ``by_class`` its step's share per cost class too (a simulation more per class)."""
    from simulator.api import simulate_scenario
    from simulator.spec.load import scenario_from_dict

    out: dict[str, Any] = {"name": row.name, "gpu": row.gpu, "gpus": row.gpus,
                           "model": row.model, "params_B": math.nan, "seq_len": row.seq_len,
                           "micro_batch_tokens": row.micro_batch * row.seq_len,
                           "replica_sequences": _replica_sequences(row),
                           "sharding": row.zero_or_fsdp, "recompute": row.recompute or "none",
                           "dtype": row.dtype,
                           "attention": "", "head_dim": math.nan, "unit": row.unit,
                           "measured": row.measured, "simulated": math.nan,
                           "error": math.nan, "exposed_comm": math.nan, "fits": None,
                           "reason": ""}
    unit = UNITS.get(row.unit.strip().lower())
    try:
        if unit is None:
            raise Unexpressed(f"unit {row.unit!r}: known units are {', '.join(UNITS)}")
        s = scenario_from_dict(scenario_data(row, method))
        out["params_B"] = param_count(s.model) / 1e9
        out["attention"], out["head_dim"] = s.stack.attention, s.model.head_size
        problems = not_yet_simulated(s)
        if problems:
            raise Unexpressed("; ".join(map(str, problems)))
        results, _ = simulate_scenario(s, method)
    except (Unexpressed, UserError) as exc:
        out["reason"] = str(exc) if isinstance(exc, Unexpressed) else "; ".join(exc.lines())
        return out
    out["simulated"] = unit(results, row)
    out["error"] = out["simulated"] / row.measured - 1
    out["exposed_comm"] = sum(results["exposed_comm_s"].values()) / results["step_time_s"]
    out["fits"] = bool(results["fits_in_memory"])
    if by_class:
        out.update(step_shares(s, method, results["step_time_s"]))
    return out


def compare_rows(rows: Sequence[Row], method: str, executor: Executor,
                 progress: Callable[[int], None] | None = None,
                 by_class: bool = False) -> pd.DataFrame:
    """The table: one entry per row, in the table's order (with ``by_class`` each row's
    cost-class shares after the :data:`COLUMNS`)."""
    futures = [executor.submit(compare_row, row, method, by_class) for row in rows]
    entries = []
    for future in futures:
        entries.append(future.result())
        if progress is not None:
            progress(1)
    return pd.DataFrame(entries, columns=[*COLUMNS, *(SHARE_COLUMNS if by_class else ())])


def regime_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per regime and group: rows compared, mean error, mean |error| and the worst."""
    done = table[table["error"].notna()].copy()
    parts = []
    for regime, key in REGIMES.items():
        if done.empty:
            break
        done["group"] = done.apply(key, axis=1)
        order = _ORDER.get(regime)
        groups = sorted(done.groupby("group"), key=lambda kv: (
            float(kv[1][order].min()) if order else 0.0, str(kv[0])))
        for group, g in groups:
            parts.append({"regime": regime, "group": group, "rows": len(g),
                          "mean_error": float(g["error"].mean()),
                          "mean_abs_error": float(g["error"].abs().mean()),
                          "worst": float(g["error"].iloc[g["error"].abs().argmax()])})
    return pd.DataFrame(parts, columns=["regime", "group", "rows", "mean_error",
                                        "mean_abs_error", "worst"])

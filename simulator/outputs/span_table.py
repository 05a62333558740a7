"""The span table: one row per span of a simulated step, built column by column.

Columns (:data:`SPAN_COLUMNS`): where it ran (``rank`` and its ``stage``,
``tp``, ``dp`` coordinates, ``stream``), what it was (``op``, ``kind``,
``name``, ``microbatch``, ``layer``, ``chunk``; ``-1`` for "no micro-batch /
layer"), when (``start``, ``end`` in seconds; ``comm_start``, when a collective's
transfer began, the time before it being peer-wait, and ``start`` for other
spans), the payload ``bytes`` (0 for compute), ``task``, the id of the
engine task that left the span (unique per row; :mod:`simulator.outputs.trace_links`
refers to spans by it), and ``weight_s``, the weight-gradient share of a fused
backward's time (the accounting's ``backward_weight``; 0 for other spans). Rows
are sorted by (rank, start, end).

Compact dtypes: int32 for indices, float64 for times and bytes, and pandas
categoricals for the four text columns, whose few distinct values repeat over
millions of rows (a 1,024-GPU full-fidelity step has ten million spans and a
few thousand distinct names).

Why columns: a full-fidelity GPT-3 run has ten million spans, and a Python
tuple per span (then a DataFrame from the tuples) cost more than half of the
simulation's own time. Here the task attributes come as arrays by task id
(:mod:`simulator.builder.columns`: a full-fidelity workload's read once per stage
prototype), the text ones as codes, and coordinates follow from the rank
arithmetically.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from simulator.builder.columns import TaskColumns, task_columns
from simulator.engine.result import SimResult

#: Column name → dtype of a span table, in file order.
SPAN_COLUMNS: Mapping[str, str] = {
    "rank": "int32",
    "stage": "int32",
    "tp": "int32",
    "dp": "int32",
    "stream": "category",
    "op": "category",
    "kind": "category",
    "name": "category",
    "microbatch": "int32",
    "layer": "int32",
    "chunk": "int32",
    "start": "float64",
    "comm_start": "float64",  # a collective: when its transfer began (the rest was peer-wait)
    "end": "float64",
    "bytes": "float64",
    "task": "int64",
    "weight_s": "float64",  # a fused backward: the weight-gradient share of its time (else 0)
}

#: Columns a span table must have; the others get the defaults below.
REQUIRED_COLUMNS = ("rank", "stream", "op", "start", "end")
_DEFAULTS: Mapping[str, Any] = {
    "stage": 0, "tp": 0, "dp": 0, "kind": "", "name": "",
    "microbatch": -1, "layer": -1, "chunk": 0, "bytes": 0.0, "task": -1, "weight_s": 0.0,
    "comm_start": np.nan,  # then start: a table from before comm_start knows no waits
}
TEXT_COLUMNS = tuple(c for c, d in SPAN_COLUMNS.items() if d == "category")


def _text(values: Any) -> pd.Categorical:
    """A categorical of strings (missing values and non-strings as their text)."""
    if isinstance(values, pd.Categorical) or isinstance(
            getattr(values, "dtype", None), pd.CategoricalDtype):
        cat = pd.Categorical(values)
        if pd.api.types.is_string_dtype(cat.categories.dtype) or cat.categories.empty:
            return cat
        return pd.Categorical(np.asarray(cat, dtype=object).astype(str))
    return pd.Categorical(pd.Series(values, dtype=object).astype(str).to_numpy(dtype=object))


def normalize_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """Return a copy with every column of :data:`SPAN_COLUMNS`, in order and dtype.

    Missing optional columns, and missing values in them, get their "none" value
    (``microbatch = -1``, ...); a missing required column is an error that names it.
    Columns beyond :data:`SPAN_COLUMNS` are kept, after them.
    """
    if [str(t) for t in spans.dtypes[:len(SPAN_COLUMNS)]] == list(SPAN_COLUMNS.values()) \
            and list(spans.columns[:len(SPAN_COLUMNS)]) == list(SPAN_COLUMNS):
        return spans.reset_index(drop=True)  # already a span table (no copy of the data)
    missing = [c for c in REQUIRED_COLUMNS if c not in spans.columns]
    if missing:
        raise ValueError(
            f"span table lacks column(s) {missing}; it has {list(spans.columns)}"
        )
    n = len(spans)
    columns: dict[str, Any] = {}
    for column, dtype in SPAN_COLUMNS.items():
        if column in spans.columns:
            values = spans[column]
            if column in _DEFAULTS and values.hasnans:  # dict records leave NaN
                values = values.astype(object).where(values.notna(), _DEFAULTS[column])
        else:
            values = pd.Series(np.full(n, _DEFAULTS[column]))
        columns[column] = (_text(values) if dtype == "category"
                           else np.asarray(values).astype(dtype, copy=False))
    unknown = np.isnan(columns["comm_start"])
    columns["comm_start"] = np.where(unknown, columns["start"], columns["comm_start"])
    for column in spans.columns:
        if column not in SPAN_COLUMNS:
            columns[column] = spans[column].to_numpy()
    return pd.DataFrame(columns)


def span_table(result: SimResult, columns: TaskColumns | None = None) -> pd.DataFrame:
    """The spans of ``result`` as a table with :data:`SPAN_COLUMNS`, sorted by
    (rank, start, end). Every task left exactly one span (the engine checks it), task
    ``i``'s at index ``i`` of the result's arrays, so attributes are read by task id
    from ``columns`` (:func:`~simulator.builder.columns.task_columns`, read here when not
    given) and gathered."""
    layout = result.workload.layout
    n = len(result.start)
    if n == 0:
        return normalize_spans(pd.DataFrame({c: [] for c in REQUIRED_COLUMNS}))
    columns = columns if columns is not None else task_columns(result.workload)
    start_all = np.asarray(result.start, dtype=np.float64)
    end_all = np.asarray(result.end, dtype=np.float64)
    rank = columns.numbers["rank"]
    order = np.lexsort((end_all, start_all, rank))
    rank, tid = rank[order], order.astype(np.int64, copy=False)
    out: dict[str, Any] = {
        "rank": rank,
        "stage": (rank // layout.per_stage).astype(np.int32),
        "tp": (rank % layout.tp).astype(np.int32),
        "dp": ((rank // (layout.tp * layout.cp)) % layout.dp).astype(np.int32),
    }
    for attr in ("stream", "op", "kind", "name"):
        out[attr] = columns.categorical(attr, tid)
    for column in ("microbatch", "layer", "chunk"):
        out[column] = columns.numbers[column][tid]
    out["start"], out["end"] = start_all[order], end_all[order]
    begin = np.asarray(result.begin, dtype=np.float64)[tid]
    out["comm_start"] = np.where(np.isnan(begin), out["start"], begin)
    out["bytes"] = columns.numbers["nbytes"][tid]
    out["task"] = tid
    out["weight_s"] = columns.numbers["weight_s"][tid]
    # copy=False: a block per column, not one consolidated 2-D block per dtype, which
    # copied every column once more (1.2 GB at GPT-3 on 1,024 GPUs, full fidelity)
    return pd.DataFrame({c: out[c] for c in SPAN_COLUMNS}, copy=False)


def stage_representatives(spans: pd.DataFrame) -> list[int]:
    """The lowest simulated rank of each pipeline stage, by stage."""
    if spans.empty:
        return []
    firsts = spans.groupby("stage", observed=True)["rank"].min()
    return [int(r) for r in firsts.sort_index()]

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
simulation's own time. Here each task attribute is read in one pass
(``map(attrgetter(...))`` into ``np.fromiter``), the three text attributes are
factorised once, and coordinates follow from the rank arithmetically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import pandas as pd

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


def _column(tasks: Sequence[Any], attr: str, dtype: Any) -> np.ndarray:
    return np.fromiter(map(attrgetter(attr), tasks), dtype, len(tasks))


class _Codes(dict[str, int]):
    """Value → code, numbering new values as they come (``map(codes.__getitem__, ...)``
    stays in C but for the first sight of each value)."""

    def __missing__(self, key: str) -> int:
        code = self[key] = len(self)
        return code


def _categorical(tasks: Sequence[Any], attr: str, order: np.ndarray) -> pd.Categorical:
    """One text attribute of every task as a categorical, in span order. A handful of
    values (stream, op, kind) are coded through a dict in the same pass that reads
    them; many (names) are factorised by pandas' hash table, faster there."""
    if attr == "name":
        codes, uniques = pd.factorize(_column(tasks, attr, object))
        categories = [str(u) for u in uniques]
    else:
        table = _Codes()
        codes = np.fromiter(map(table.__getitem__, map(attrgetter(attr), tasks)), np.int32,
                            len(tasks))
        categories = list(table)
    return pd.Categorical.from_codes(codes[order].astype(np.int32, copy=False), categories)


def _comm_start(comm_start: Mapping[int, float], n_tasks: int, tid: np.ndarray,
                start: np.ndarray) -> np.ndarray:
    """The engine's transfer start of each collective, else the span's start."""
    by_task = np.full(n_tasks, np.nan)
    if comm_start:
        keys = np.fromiter(comm_start.keys(), np.int64, len(comm_start))
        by_task[keys] = np.fromiter(comm_start.values(), np.float64, len(comm_start))
    begin = by_task[tid]
    return np.where(np.isnan(begin), start, begin)


def span_table(result: SimResult) -> pd.DataFrame:
    """The spans of ``result`` as a table with :data:`SPAN_COLUMNS`, sorted by
    (rank, start, end). Every task left exactly one span (the engine checks it) and
    task ``i`` is ``tasks[i]``, so attributes are read in task order and gathered."""
    spans, tasks, layout = result.spans, result.workload.tasks, result.workload.layout
    n = len(spans)
    if n == 0:
        return normalize_spans(pd.DataFrame({c: [] for c in REQUIRED_COLUMNS}))
    tid = np.fromiter(map(itemgetter(0), spans), np.int64, n)
    start = np.fromiter(map(itemgetter(1), spans), np.float64, n)
    end = np.fromiter(map(itemgetter(2), spans), np.float64, n)
    rank_of_task = _column(tasks, "rank", np.int32)
    rank = rank_of_task[tid]
    order = np.lexsort((end, start, rank))
    rank, tid = rank[order], tid[order]
    columns: dict[str, Any] = {
        "rank": rank,
        "stage": (rank // layout.per_stage).astype(np.int32),
        "tp": (rank % layout.tp).astype(np.int32),
        "dp": ((rank // (layout.tp * layout.cp)) % layout.dp).astype(np.int32),
    }
    for attr in ("stream", "op", "kind", "name"):
        columns[attr] = _categorical(tasks, attr, tid)
    for column, attr in (("microbatch", "microbatch"), ("layer", "layer"), ("chunk", "chunk")):
        columns[column] = _column(tasks, attr, np.int32)[tid]
    columns["start"], columns["end"] = start[order], end[order]
    columns["comm_start"] = _comm_start(result.comm_start, len(tasks), tid, columns["start"])
    columns["bytes"] = _column(tasks, "nbytes", np.float64)[tid]
    columns["task"] = tid
    columns["weight_s"] = _column(tasks, "weight_s", np.float64)[tid]
    return pd.DataFrame({c: columns[c] for c in SPAN_COLUMNS})


def stage_representatives(spans: pd.DataFrame) -> list[int]:
    """The lowest simulated rank of each pipeline stage, by stage."""
    if spans.empty:
        return []
    firsts = spans.groupby("stage", observed=True)["rank"].min()
    return [int(r) for r in firsts.sort_index()]

"""The bulk of a run's results as Parquet tables beside ``results.json``.

``results.json`` holds a run's summary figures. Three lists in the results dict grow
with the step or the cluster (a segment per change of the critical path, a point per
allocation change of each stage's memory curve, an entry per simulated rank: 0.8 kB a
rank, 13.7 MB at 16,384 ranks) and made it megabytes. A run directory stores each as a
table of its own (:data:`TABLES`); the time breakdown only when it has more than
:data:`INLINE_RANKS` entries (a full-fidelity run of a large cluster): a folded run's
few entries stay inline, where readers of ``results.json`` have always found them.

- ``critical_path.parquet``: one row per segment of the step's critical path,
  earliest first: ``rank`` (int32), ``start``, ``end`` (float64, seconds),
  ``category`` (dictionary-encoded text);
- ``memory_timeline.parquet``: one row per point of each curve, ranks in the
  order results had them: ``rank``, ``stage`` (int32), ``t`` (float64, seconds),
  ``bytes`` (float64, allocated bytes from ``t`` on);
- ``time_breakdown.parquet``: ``time_breakdown_s`` above :data:`INLINE_RANKS` entries,
  one row per simulated rank, its keys as columns in their order: ``rank``,
  ``stage`` (and ``ranks``, the ranks an entry stands for, in asymmetric folding) as
  int64, each accounting category's seconds as float64.

``results.json`` keeps the summaries (``critical_path_s``, ``step_breakdown_s``, ``memory``,
``memory_peak_bytes``) and, under ``tables``, each table's file name by its
results key (``{"critical_path": "critical_path.parquet", ...}``), so a reader
knows where the rows are. The in-memory results dict (:func:`simulator.api.run_scenario`)
still holds the lists; :func:`split_tables` takes them out when writing and
:func:`attach_tables` puts them back when reading, so plots and the trace see one
form. A ``results.json`` of an older run, with the lists inline, reads as it is.
Floats are stored as float64: the lists read back equal to what was written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.errors import Problem, UserError
from simulator.outputs.writing import atomic_output

if TYPE_CHECKING:
    import pandas as pd

TABLES_KEY = "tables"
#: A time breakdown of at most this many entries (ranks) stays in results.json (~0.2 MB).
INLINE_RANKS = 256
_FIX = "run the scenario again (`clustersim run SCENARIO --out DIR`)"


def _path_frame(segments: list[Mapping[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    frame = pd.DataFrame(list(segments), columns=["rank", "start", "end", "category"])
    return frame.astype({"rank": "int32", "start": "float64", "end": "float64",
                         "category": "category"})


def _path_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{"rank": int(r), "start": float(a), "end": float(b), "category": str(c)}
            for r, a, b, c in zip(frame["rank"].tolist(), frame["start"].tolist(),
                                  frame["end"].tolist(), frame["category"].tolist(),
                                  strict=True)]


def _curve_frame(curves: list[Mapping[str, Any]]) -> pd.DataFrame:
    import numpy as np
    import pandas as pd

    sizes = [len(c["points"]) for c in curves]
    points = np.array([p for c in curves for p in c["points"]], dtype=float).reshape(-1, 2)
    return pd.DataFrame({
        "rank": np.repeat([int(c["rank"]) for c in curves], sizes).astype("int32"),
        "stage": np.repeat([int(c["stage"]) for c in curves], sizes).astype("int32"),
        "t": points[:, 0], "bytes": points[:, 1]})


def _curve_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ranks, stages = frame["rank"].tolist(), frame["stage"].tolist()
    for i, (rank, t, nbytes) in enumerate(zip(ranks, frame["t"].tolist(),
                                              frame["bytes"].tolist(), strict=True)):
        if not out or out[-1]["rank"] != rank:
            out.append({"rank": int(rank), "stage": int(stages[i]), "points": []})
        out[-1]["points"].append([float(t), float(nbytes)])
    return out


def _record_frame(entries: list[Mapping[str, Any]]) -> pd.DataFrame:
    """Entries with the same keys as columns: integers (not bools) as int64, the rest
    float64."""
    import pandas as pd

    frame = pd.DataFrame.from_records(list(entries), columns=list(entries[0]) if entries
                                      else None)
    ints = {k for k, v in (entries[0].items() if entries else ())
            if isinstance(v, int) and not isinstance(v, bool)}
    return frame.astype({c: "int64" if c in ints else "float64" for c in frame.columns})


def _record_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    columns = [(c, int if frame[c].dtype.kind in "iu" else float, frame[c].tolist())
               for c in frame.columns]
    return [{c: kind(values[i]) for c, kind, values in columns} for i in range(len(frame))]


@dataclass(frozen=True)
class ResultTable:
    """One list of the results dict and the Parquet file that holds it."""

    key: str  # the results key
    file: str  # the file name in the run directory
    columns: tuple[str, ...]  # the columns read back (every column when empty)
    to_frame: Callable[[list[Mapping[str, Any]]], pd.DataFrame]
    to_rows: Callable[[pd.DataFrame], list[dict[str, Any]]]
    inline_max: int = -1  # a list of at most this many entries stays in results.json


TABLES: dict[str, ResultTable] = {t.key: t for t in (
    ResultTable("critical_path", "critical_path.parquet",
                ("rank", "start", "end", "category"), _path_frame, _path_rows),
    ResultTable("memory_timeline", "memory_timeline.parquet",
                ("rank", "stage", "t", "bytes"), _curve_frame, _curve_rows),
    ResultTable("time_breakdown_s", "time_breakdown.parquet", (), _record_frame,
                _record_rows, INLINE_RANKS),
)}
TABLE_FILES = tuple(t.file for t in TABLES.values())


def split_tables(results: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
    """``results`` less its tables (with the ``tables`` pointer), and the tables as
    frames by file name. A list that is absent or None stays out of both; one no longer
    than its table's ``inline_max`` stays in ``results``."""
    frames, inline = {}, set()
    for key, table in TABLES.items():
        rows = results.get(key)
        if isinstance(rows, list) and len(rows) <= table.inline_max:
            inline.add(key)
        elif isinstance(rows, list):
            frames[table.file] = table.to_frame(rows)
    summary = {k: v for k, v in results.items() if k not in TABLES or k in inline}
    if frames:
        summary[TABLES_KEY] = {k: t.file for k, t in TABLES.items() if t.file in frames}
    return summary, frames


def write_tables(out_dir: Path, frames: Mapping[str, pd.DataFrame]) -> list[Path]:
    """Each frame as ``out_dir/<name>`` (Parquet, zstd), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = []
    for name, frame in frames.items():
        table = pa.Table.from_pandas(frame, preserve_index=False)
        with atomic_output(out_dir / name) as tmp:
            pq.write_table(table, tmp, compression="zstd")
        written.append(out_dir / name)
    return written


def read_table_rows(path: Path, table: ResultTable) -> list[dict[str, Any]]:
    """The rows of one table file as the results dict holds them; a missing, cut or
    foreign file is one line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    field = f"run_dir: {path.name}"
    if not path.is_file():
        raise UserError([Problem(field, str(path), f"is missing (results.json names it for "
                                 f"{table.key}); {_FIX}")])
    try:
        frame = pq.read_table(path, columns=list(table.columns) or None).to_pandas()
        return table.to_rows(frame)
    except (pa.ArrowException, OSError, KeyError, ValueError, TypeError) as exc:
        raise UserError([Problem(field, str(path), f"is not a readable {table.key} table "
                                 f"({str(exc).splitlines()[0][:80]}); {_FIX}")]) from None


def attach_tables(results: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """``results`` (read from ``run_dir/results.json``) with each table its ``tables``
    entry names read back in place of the pointer, the in-memory form again; inline
    lists (an older run) are kept as they are."""
    pointers = results.get(TABLES_KEY)
    if not isinstance(pointers, Mapping):
        return results
    out = {k: v for k, v in results.items() if k != TABLES_KEY}
    for key, name in pointers.items():
        table = TABLES.get(str(key))
        if table is None or isinstance(out.get(key), list):
            continue
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise UserError([Problem(f"run_dir: results.json: tables.{key}", repr(name)[:40],
                                     f"is not a file name in the run directory; {_FIX}")])
        out[key] = read_table_rows(run_dir / name, table)
    return out

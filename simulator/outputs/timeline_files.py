"""The timeline on disk: ``timeline.parquet`` (default) and ``timeline.csv`` (on request).

A run directory holds the span table (:mod:`simulator.outputs.span_table`) in one or
both formats; every reader (``clustersim plot``, :mod:`simulator.outputs.plots.figures`,
notebooks, tests) goes through :func:`read_timeline`, which takes whichever
exists, Parquet first.

Parquet (Apache Arrow's writer): the text columns are stored dictionary-encoded
(the categoricals' codes), integers as int32, times and bytes as float64,
compressed with zstd, in row groups of :data:`ROW_GROUP_ROWS` rows. Times and
task ids, distinct in nearly every row, skip the dictionary; times are stored
byte-stream-split (the bytes of each significance together), which compresses
better and writes faster. Rows are sorted by rank and only ``rank`` and
``stage`` carry statistics, so a reader that wants a few ranks (the timeline
plot draws one per stage) skips the row groups of the others.

CSV round-trips floats exactly (shortest repr) and keeps an empty name and a
name such as "NA" as text. Both writers are atomic (:func:`atomic_output`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import pandas as pd

from simulator.outputs.span_table import SPAN_COLUMNS, normalize_spans, stage_representatives
from simulator.outputs.trace_export import atomic_output

TimelineFormat = Literal["parquet", "csv", "both"]
TIMELINE_FORMATS: tuple[str, ...] = ("parquet", "csv", "both")
TIMELINE_FILES = ("timeline.parquet", "timeline.csv")  # the order readers prefer
ROW_GROUP_ROWS = 256 * 1024
# distinct in almost every row: no dictionary (it would be built, then dropped); the
# times' bytes split by significance, which zstd compresses better (and faster)
_UNIQUE = ("start", "comm_start", "end", "task")
_SPLIT = ("start", "comm_start", "end")  # floats: BYTE_STREAM_SPLIT since Arrow 3


def write_timeline_parquet(path: str | os.PathLike[str], spans: pd.DataFrame) -> Path:
    """Write the span table as Parquet (see the module notes), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(normalize_spans(spans), preserve_index=False)
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", row_group_size=ROW_GROUP_ROWS,
                       use_dictionary=[c for c in table.column_names if c not in _UNIQUE],
                       column_encoding=dict.fromkeys(_SPLIT, "BYTE_STREAM_SPLIT"),
                       write_statistics=["rank", "stage"])
    return Path(path)


def write_timeline_csv(path: str | os.PathLike[str], spans: pd.DataFrame) -> Path:
    """Write the span table as CSV (floats round-trip exactly), atomically."""
    table = normalize_spans(spans)
    with atomic_output(path) as tmp:
        table.to_csv(tmp, index=False, float_format=None)
    return Path(path)


def write_timeline(out_dir: str | os.PathLike[str], spans: pd.DataFrame,
                   fmt: str = "parquet") -> list[Path]:
    """Write ``timeline.parquet``, ``timeline.csv`` or both into ``out_dir``; remove a
    stale file of the format not written (so readers never see an older run's)."""
    if fmt not in TIMELINE_FORMATS:
        raise ValueError(f"timeline format {fmt!r}: use one of {', '.join(TIMELINE_FORMATS)}")
    out = Path(out_dir)
    written = []
    if fmt in ("parquet", "both"):
        written.append(write_timeline_parquet(out / "timeline.parquet", spans))
    if fmt in ("csv", "both"):
        written.append(write_timeline_csv(out / "timeline.csv", spans))
    for name in TIMELINE_FILES:
        if out / name not in written:
            (out / name).unlink(missing_ok=True)
    return written


def timeline_path(run_dir: str | os.PathLike[str]) -> Path | None:
    """The run directory's timeline file (Parquet if both exist), or None."""
    for name in TIMELINE_FILES:
        path = Path(run_dir) / name
        if path.is_file():
            return path
    return None


def read_timeline_csv(path: str | os.PathLike[str],
                      ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """Read a ``timeline.csv`` back with the dtypes of :data:`SPAN_COLUMNS`."""
    dtypes = {c: (object if d == "category" else d) for c, d in SPAN_COLUMNS.items()}
    # keep_default_na=False keeps an empty name "" (and an op called "NA") as text.
    table = pd.read_csv(path, dtype=dtypes, keep_default_na=False)
    if ranks is not None:
        table = table[table["rank"].isin(list(ranks))]
    return normalize_spans(table)


def read_timeline_parquet(path: str | os.PathLike[str],
                          ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """Read a ``timeline.parquet``, only the rows of ``ranks`` when given."""
    import pyarrow.parquet as pq

    filters = None if ranks is None else [("rank", "in", sorted({int(r) for r in ranks}))]
    table = pq.read_table(path, filters=filters)
    return normalize_spans(table.to_pandas())


def read_timeline(run_dir_or_file: str | os.PathLike[str],
                  ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """The span table of a run directory (or of one timeline file), all ranks or
    those in ``ranks``. Raises FileNotFoundError naming both files when neither exists."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        found = timeline_path(path)
        if found is None:
            raise FileNotFoundError(f"{path} has neither {' nor '.join(TIMELINE_FILES)}")
        path = found
    if path.suffix == ".parquet":
        return read_timeline_parquet(path, ranks)
    return read_timeline_csv(path, ranks)


def timeline_stage_ranks(run_dir_or_file: str | os.PathLike[str]) -> list[int]:
    """The lowest rank of each pipeline stage in a timeline file, read cheaply (only
    the ``rank`` and ``stage`` columns)."""
    path = Path(run_dir_or_file)
    found = timeline_path(path) if path.is_dir() else path
    if found is None:
        return []
    if found.suffix == ".parquet":
        import pyarrow.parquet as pq

        cols = pq.read_table(found, columns=["rank", "stage"]).to_pandas()
    else:
        cols = pd.read_csv(found, usecols=["rank", "stage"])
    return stage_representatives(cols)


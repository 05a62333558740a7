"""The timeline on disk: Parquet and CSV round trips, readers take whichever exists,
rank filters, stale files, normalisation."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from simulator.outputs.span_table import SPAN_COLUMNS, TEXT_COLUMNS, normalize_spans
from simulator.outputs.timeline_files import (
    read_timeline,
    read_timeline_csv,
    timeline_path,
    timeline_stage_ranks,
    write_timeline,
    write_timeline_csv,
    write_timeline_parquet,
)
from tests.test_trace_export import gpipe_spans


def tricky_spans() -> pd.DataFrame:
    spans = gpipe_spans()
    spans.loc[0, "start"] = 0.1 + 0.2  # not representable in a short decimal
    spans.loc[0, "end"] = 1e-7 / 3 + 1.0
    spans.loc[1, "name"] = "NA"  # must not come back as a missing value
    return spans


def check_dtypes(table: pd.DataFrame) -> None:
    assert list(table.columns) == list(SPAN_COLUMNS)
    for column, dtype in SPAN_COLUMNS.items():
        assert str(table[column].dtype) == dtype, column


@pytest.mark.parametrize("writer", [write_timeline_csv, write_timeline_parquet])
def test_round_trip_preserves_values_and_dtypes(tmp_path: Path, writer) -> None:  # type: ignore[no-untyped-def]
    spans = tricky_spans()
    path = writer(tmp_path / "timeline", spans)
    back = read_timeline(path.rename(path.with_suffix(
        ".parquet" if writer is write_timeline_parquet else ".csv")))
    check_dtypes(back)
    expected = normalize_spans(spans)
    as_text = dict.fromkeys(TEXT_COLUMNS, str)  # category order may differ
    pd.testing.assert_frame_equal(back.astype(as_text), expected.astype(as_text))
    assert back.loc[0, "start"] == 0.1 + 0.2
    assert back.loc[1, "name"] == "NA" and back.iloc[-1]["name"] == ""
    assert back.loc[back["op"] == "dp.all_reduce", "name"].iloc[0] == 'grads, "bucket" 0'


def test_parquet_stores_compact_types(tmp_path: Path) -> None:
    path = write_timeline_parquet(tmp_path / "timeline.parquet", gpipe_spans())
    schema = pq.read_schema(path)
    assert str(schema.field("rank").type) == "int32"
    assert str(schema.field("start").type) == "double"
    assert str(schema.field("name").type).startswith("dictionary<values=string")
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_rank_filter_reads_only_those_ranks(tmp_path: Path, fmt: str) -> None:
    write_timeline(tmp_path, gpipe_spans(), fmt)
    back = read_timeline(tmp_path, ranks=[1])
    assert set(back["rank"]) == {1} and len(back) == (gpipe_spans()["rank"] == 1).sum()
    assert timeline_stage_ranks(tmp_path) == [0, 1]


def test_readers_prefer_parquet_and_formats_replace_each_other(tmp_path: Path) -> None:
    assert timeline_path(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"timeline\.parquet nor timeline\.csv"):
        read_timeline(tmp_path)
    names = [p.name for p in write_timeline(tmp_path, gpipe_spans(), "both")]
    assert names == ["timeline.parquet", "timeline.csv"]
    assert timeline_path(tmp_path) == tmp_path / "timeline.parquet"
    write_timeline(tmp_path, gpipe_spans().iloc[:3], "csv")  # a later run: CSV only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.csv"]
    assert len(read_timeline(tmp_path)) == 3
    with pytest.raises(ValueError, match="use one of parquet, csv, both"):
        write_timeline(tmp_path, gpipe_spans(), "json")


def test_normalize_fills_optional_columns_and_names_missing_ones() -> None:
    minimal = pd.DataFrame({"rank": [3], "stream": ["compute"], "op": ["F"],
                            "start": [0.0], "end": [1.0]})
    table = normalize_spans(minimal)
    check_dtypes(table)
    row = table.iloc[0]
    assert (row["microbatch"], row["layer"], row["chunk"], row["bytes"], row["name"],
            row["task"]) == (-1, -1, 0, 0.0, "", -1)
    with pytest.raises(ValueError, match=re.escape("['end']")):
        normalize_spans(minimal.drop(columns="end"))


def test_csv_reader_keeps_text_that_looks_missing(tmp_path: Path) -> None:
    path = write_timeline_csv(tmp_path / "timeline.csv", tricky_spans())
    back = read_timeline_csv(path)
    assert "NA" in set(back["name"]) and "" in set(back["name"])

"""Weak scaling in ``clustersim validate-runs`` (:mod:`simulator.published.scaling`): rows
that differ only in their GPU count form a series, and each count's per-GPU rate is set
over the series' smallest, measured and simulated."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import pandas as pd
import pytest
from test_published import _write

from simulator.cli.main import main
from simulator.published.compare import COLUMNS as TABLE_COLUMNS
from simulator.published.rows import read_rows
from simulator.published.scaling import COLUMNS as SCALING_COLUMNS
from simulator.published.scaling import per_gpu, scaling_line, weak_scaling

ROOT = Path(__file__).resolve().parent.parent
DEV_SET = ROOT / "docs" / "validation" / "published" / "llm-foundry.csv"


def _row(gpus: int, measured: float, simulated: float, **over: object) -> dict[str, object]:
    base: dict[str, object] = dict.fromkeys(TABLE_COLUMNS, "")
    base.update({"name": f"r{gpus}", "gpu": "H100", "gpus": gpus, "model": "m",
                 "seq_len": 2048, "micro_batch_tokens": 16384, "replica_sequences": 8.0,
                 "sharding": "FSDP FULL_SHARD", "recompute": "none", "dtype": "bf16",
                 "attention": "flash2", "unit": "tokens/s/GPU", "measured": measured,
                 "simulated": simulated, "error": simulated / measured - 1})
    base.update(over)
    return base


def test_a_series_reads_each_count_over_its_smallest() -> None:
    table = pd.DataFrame([_row(128, 1000.0, 1100.0), _row(256, 950.0, 1089.0),
                          _row(512, 900.0, 1078.0)])
    out = weak_scaling(table)
    assert list(out.columns) == list(SCALING_COLUMNS)
    assert list(out["gpus"]) == [256, 512] and set(out["gpus_base"]) == {128}
    assert out["measured_ratio"].tolist() == pytest.approx([0.95, 0.90])
    assert out["simulated_ratio"].tolist() == pytest.approx([0.99, 0.98])
    assert out["gap"].tolist() == pytest.approx([0.99 / 0.95 - 1, 0.98 / 0.90 - 1])
    line = scaling_line(out)
    assert line is not None and "1 series" in line and "measured x0.900" in line \
        and "simulated x0.980" in line


def test_rows_that_differ_in_more_than_gpus_are_other_series() -> None:
    """Another accumulation (sequences a replica runs), sharding or kernel is not weak
    scaling; a lone count is no series; a row not compared takes no part."""
    table = pd.DataFrame([
        _row(8, 1000.0, 1000.0, replica_sequences=24.0), _row(16, 1100.0, 990.0),
        _row(32, 900.0, 900.0, sharding="FSDP SHARD_GRAD_OP"),
        _row(64, 900.0, 900.0, attention="flash_triton"),
        _row(128, 800.0, math.nan, error=math.nan)])
    assert weak_scaling(table).empty and scaling_line(weak_scaling(table)) is None


@pytest.mark.parametrize(("unit", "value", "gpus", "rate"), [
    ("tokens/s/GPU", 1000.0, 8, 1000.0), ("MFU", 0.4, 8, 0.4), ("tokens/s", 8000.0, 8, 1000.0),
    ("seq/s", 16.0, 8, 2.0), ("s/step", 4.0, 8, 0.25)])
def test_each_unit_becomes_a_per_gpu_rate(unit: str, value: float, gpus: int,
                                          rate: float) -> None:
    assert per_gpu(value, unit, gpus) == pytest.approx(rate)


def test_peak_memory_is_not_a_rate() -> None:
    assert math.isnan(per_gpu(40.0, "peak_memory_GB", 8))


def test_the_command_writes_the_scaling_table(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The development set's 1B rows on 16, 32 and 64 H100 (same micro-batch, one
    micro-batch a step): one series, in scaling.csv, runs.md and the printed line."""
    rows = list(csv.DictReader(io.StringIO(DEV_SET.read_text())))
    series = [r for r in rows if r["name"].startswith("llmfoundry_h100_bf16_mpt1b_seq2048_")
              and r["gpus"] in ("16", "32", "64")]
    assert len(series) == 3
    path = _write(tmp_path / "runs.csv", series)
    out = tmp_path / "out"
    assert main(["validate-runs", str(path), "--out", str(out), "--workers", "1",
                 "--no-plots"]) == 0
    assert "weak scaling (1 series" in capsys.readouterr().out
    table = pd.read_csv(out / "scaling.csv")
    assert list(table["gpus"]) == [32, 64] and set(table["gpus_base"]) == {16}
    measured = {int(r.gpus): r.measured for r in read_rows(path)}
    assert table["measured_ratio"].tolist() == pytest.approx(
        [measured[32] / measured[16], measured[64] / measured[16]])
    assert "## Weak scaling" in (out / "runs.md").read_text()

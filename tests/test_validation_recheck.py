"""The machine after a validation's last row (calibration/measured/recheck.py): the
two-rank terms fitted from a launch's records as the profile keeps them, the profile's
own figures, the one line the tables end with, and ``--no-recheck``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_funcol_host import LINES_US
from test_funcol_host import _record as funcol_record

from calibration.measured import recheck
from calibration.measured import validation as val


def _spread_record() -> dict[str, Any]:
    """Two ranks, one round of two iterations: 1.0/1.2 s and 2.0/2.0 s, so the slower
    rank is 1/11 and 0 over the mean: excess 1/22, spread (1/22)·√π."""
    return {"key": "cpu/t1/rank_spread/n2", "kind": "rank_spread", "ok": True, "nranks": 2,
            "burst_s": 0.016, "iterations": 2, "rounds": [[[1.0, 2.0], [1.2, 2.0]]]}


def test_figures_are_the_calibrations_fits_in_the_profiles_units() -> None:
    now = recheck.figures([_spread_record(), funcol_record(),
                           {"kind": "send_sync", "ok": False}])
    assert now["rank_spread"] == pytest.approx(math.sqrt(math.pi) / 22)
    for kind, (a, _) in LINES_US.items():
        assert now[f"funcol_host.{kind}"] == pytest.approx(a)
    assert now["send_sync_us"] is None and now["collective_sync_us"] is None
    assert now["interference"] is None


def test_the_line_puts_the_profiles_figure_beside_each_term() -> None:
    profile = {"gpu": {"rank_spread": 0.056,
                       "funcol_host": {"all_gather": {"us": 815.9, "us_per_mib": 90.0}},
                       "interference": {"intra_node": 1.38}}}
    then = recheck.calibrated(profile)
    assert then == {"rank_spread": 0.056, "collective_sync_us": None,
                    "funcol_host.all_reduce": None, "funcol_host.all_gather": 815.9,
                    "funcol_host.reduce_scatter": None, "send_sync_us": None,
                    "interference": 1.38}
    line = recheck.sentence({"rank_spread": 0.19, "funcol_host.all_gather": 1100.0,
                             "collective_sync_us": 1600.0, "interference": None}, then)
    assert line.startswith("The machine after the last row") and "\n" not in line
    assert "rank spread 0.190 (0.056), collective sync 1600 us (none), " \
           "funcol host all-gather 1100 us (816 us)." in line
    assert "interference" not in line
    assert recheck.sentence({}, then) == ""


def test_the_tables_end_with_it_and_no_recheck_skips_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    header = {"device": "cpu", "device_name": "vm", "threads": 1, "torch": "x",
              "profile": "p.yaml", "date": "d", "micro_batches": 4, "micro_batch_size": 2,
              "steps": 8, "model": "small-gpt", "recheck": "The machine after the last row."}
    assert val.markdown([], header).rstrip().endswith("The machine after the last row.")
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"gpu": {"rank_spread": 0.05}}))
    calls: list[tuple[Any, ...]] = []

    def remeasure(*a: Any) -> dict[str, float | None]:
        calls.append(a)
        return {"rank_spread": 0.2}
    monkeypatch.setattr(recheck, "remeasure", remeasure)
    args = argparse.Namespace(no_recheck=True, device="cpu", threads=1, timeout=60.0)
    assert val._recheck(args, tmp_path, str(profile)) == "" and not calls
    args.no_recheck = False
    assert "rank spread 0.200 (0.050)" in val._recheck(args, tmp_path, str(profile))
    assert calls == [("cpu", 1, tmp_path, 60.0)]

"""The measured PowerSGD run: PyTorch's DDP hook under gloo, its scenario and checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from calibration.measured.compression_hook import POWERSGD_BUCKET_MB
from calibration.measured.measure import make_config, run_measure, scenario_yaml
from simulator.spec.load import scenario_from_dict

TINY = {"layers": 2, "hidden": 32, "heads": 2, "ffn_hidden": 64, "vocab": 64, "seq_len": 16}
PROFILE = Path(__file__).resolve().parent.parent / "calibration/profiles/cpu-epyc-1thread.yaml"


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"dp": 1}, "needs dp > 1"),
    ({"dp": 2, "zero": 3}, "needs dp > 1, zero 0 and tp 1"),
    ({"dp": 2, "warmup": 1}, "warmup=1"),
])
def test_powersgd_run_refusals(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        make_config(tp=1, pp=1, **{"model": TINY, "powersgd_rank": 4, **kwargs})


def test_scenario_of_a_powersgd_run() -> None:
    cfg = make_config(tp=1, pp=1, dp=2, model=TINY, powersgd_rank=4, warmup=3)
    scenario = yaml.safe_load(scenario_yaml(cfg))
    assert scenario["training"]["gradient_compression"] == {
        "method": "powersgd", "rank": 4, "start_step": 3}
    assert scenario["parallel"]["dp_bucket_MB"] == POWERSGD_BUCKET_MB
    assert scenario["name"].endswith("-powersgd4")
    scenario_from_dict(scenario)  # the simulator takes it as it is


def test_powersgd_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two gloo ranks train with the hook: the profiled (compressed) step runs the
    hook's QR orthogonalisation (rank 4 > 2), and compare simulates the same scenario."""
    from simulator.cli.main import main

    result = run_measure(tp=1, pp=1, dp=2, model=TINY, micro_batches=2, steps=2, warmup=2,
                         device="cpu", out_dir=tmp_path, timeout_s=180, powersgd_rank=4)
    assert all(loss == loss for loss in result["losses"])
    trace = json.loads((tmp_path / "traces" / "trace_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("linalg_qr" in n for n in names)  # the hook orthogonalises Q and P (r > 2)
    assert main(["compare", str(tmp_path), "--profile", str(PROFILE)]) == 0
    comparison = json.loads((tmp_path / "comparison.json").read_text())
    compression = comparison["scenario"]["training"]["gradient_compression"]
    assert compression["method"] == "powersgd" and compression["rank"] == 4


def test_kernel_table_prices_every_kernel() -> None:
    """The diagnostic behind the validation table's PowerSGD row: every kernel measured and
    priced."""
    from calibration.measured.powersgd_kernels import kernel_table

    rows = kernel_table(str(PROFILE), "tiny-gpt", rank=4, repeats=3)
    assert [r[0] for r in rows][:3] == ["P = M·Q", "Q = Mᵀ·P", "M = P·Qᵀ"]
    assert len(rows) == 6 and all(m > 0 and s > 0 for _, m, s in rows)

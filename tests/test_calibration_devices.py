"""One device-name table (simulator/system/devices.py): the measured run's scenario and the
calibration's datasheet peaks name the same bundled preset for every CUDA device name,
a bare "A100" included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from calibration.measured.measure_config import make_config
from calibration.measured.measure_scenario import scenario_dict, system_name
from calibration.microbench.fit_profile import datasheet_preset, fit_compute
from simulator.system.devices import DEVICE_PRESETS, preset_for
from simulator.system.profiles import load_system

#: what torch.cuda.get_device_name() reports, and the preset each one is
REAL_NAMES = {
    "NVIDIA GB200": "gb200-nvl72",
    "NVIDIA B200": "dgx-b200",
    "NVIDIA H200": "dgx-h200",
    "NVIDIA H100 80GB HBM3": "dgx-h100",
    "NVIDIA A100-SXM4-80GB": "dgx-a100-80gb",
    "NVIDIA A100-SXM4-40GB": "dgx-a100-40gb",
    "NVIDIA A100-PCIE-40GB": "dgx-a100-40gb",
    "NVIDIA A100 80GB PCIe": "dgx-a100-80gb",
}
#: each table entry spelled as a name: its words alone, and after the vendor
TABLE_NAMES = [spelling for words, _ in DEVICE_PRESETS
               for spelling in (" ".join(words).upper(), "NVIDIA " + "-".join(words).upper())]
NAMES = [*REAL_NAMES, *TABLE_NAMES, "A100"]


def _gpu_config(tmp_path: Path) -> Any:
    cfg = make_config(tp=1, pp=1, dp=1, out_dir=tmp_path)
    return cfg.__class__(**{**cfg.__dict__, "device": "cuda"})


def _gemm_records(rate: float) -> list[dict[str, Any]]:
    """bf16 GEMM records of a CUDA device at ``rate`` FLOP/s, well under any datasheet."""
    out = []
    for i, n in enumerate((256, 512, 1024, 2048, 4096, 8192)):
        flops = 2.0 * n ** 3
        out.append({"key": f"cuda/bf16/t1/gemm/{i}", "kind": "gemm", "ok": True,
                    "device": "cuda", "dtype": "bf16", "threads": 1, "m": n, "n": n, "k": n,
                    "flops": flops, "time_s": flops / rate})
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_scenario_and_the_calibration_name_the_same_preset(tmp_path: Path,
                                                               name: str) -> None:
    preset = preset_for(name)
    assert preset is not None
    assert system_name(_gpu_config(tmp_path), name) == preset
    assert scenario_dict(_gpu_config(tmp_path), name)["cluster"]["system"] == preset
    assert datasheet_preset(name) == preset
    fits = fit_compute(_gemm_records(1e12), "cuda", "bf16", 1, name)
    assert fits.peak_source == f"datasheet (preset {load_system(preset).name})"


@pytest.mark.parametrize(("name", "preset"), REAL_NAMES.items())
def test_real_device_names_pick_their_memory(name: str, preset: str) -> None:
    assert preset_for(name) == preset


def test_a_bare_a100_is_the_40gb_part(tmp_path: Path) -> None:
    assert preset_for("A100") == "dgx-a100-40gb"
    assert system_name(_gpu_config(tmp_path), "A100") == "dgx-a100-40gb"


def test_an_unknown_device_has_no_preset(tmp_path: Path) -> None:
    assert preset_for("Some GPU 9") is None is datasheet_preset("Some GPU 9")
    assert system_name(_gpu_config(tmp_path), "Some GPU 9") == "some-gpu-9"
    fits = fit_compute(_gemm_records(1e12), "cuda", "bf16", 1, "Some GPU 9")
    assert fits.peak_source == "best measured bf16 GEMM rate"

"""The burst-against-sustained probe (calibration/microbench/sustained.py) on its CPU path:
the JSON it writes (atomically, after each phase), the ratio recomputed from the JSON's own
windows, the one-line errors, and the nvidia-smi sampler's plumbing against a stand-in
nvidia-smi (the real one needs the GPU machine). No speed is asserted."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from calibration.microbench import sustained, sustained_smi

ROOT = Path(__file__).resolve().parent.parent
TOP_KEYS = {"schema", "torch", "device", "device_name", "dtype", "started_utc", "settings",
            "nvidia_smi", "phases"}
PHASE_KEYS = {"kernel", "shape", "flops_per_call", "burst", "window_s", "windows",
              "sustained_tflops", "sustained_windows", "ratio", "clocks", "samples"}


def _tflops(calls: int, flops: float, seconds: float) -> float:
    return calls * flops / seconds / 1e12


def test_cpu_probe_writes_every_field_and_its_ratio_follows_from_its_windows(tmp_path,
                                                                                  monkeypatch,
                                                                                  capsys):
    out = tmp_path / "s.json"
    snapshots = []
    renames = []
    real_write, real_replace = sustained.write, Path.replace

    def spy_write(result, path):
        snapshots.append(json.loads(json.dumps(result)))
        real_write(result, path)

    def spy_replace(self, target):
        renames.append((Path(self), Path(target)))
        return real_replace(self, target)

    monkeypatch.setattr(sustained, "write", spy_write)
    monkeypatch.setattr(Path, "replace", spy_replace)
    rc = sustained.main(["--out", str(out), "--device", "cpu", "--seconds", "0.4",
                         "--size", "32", "--idle", "0"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "gemm 32³: sustained/burst" in printed and f"wrote {out}" in printed

    # written after each phase: first with the attention phase still null
    assert [s["phases"]["attention"] is None for s in snapshots] == [True, False]
    # each write a rename of a temporary file beside it; nothing else left there
    assert [t for _, t in renames] == [out, out]
    assert all(src.parent == out.parent and src != out for src, _ in renames)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]

    data = json.loads(out.read_text())
    assert set(data) == TOP_KEYS
    assert data["schema"] == sustained.SCHEMA and data["device"] == "cpu"
    assert data["dtype"] == "fp32" and data["nvidia_smi"] is None
    assert data["settings"] == {"seconds": 0.4, "size": 32, "idle_s": 0.0,
                                "warmup_s": sustained.WARMUP_S, "burst_s": sustained.BURST_S}
    for name, flops in (("gemm", 2 * 32**3), ("attention", 6.0 * 1 * 2 * 128**2 * 32)):
        p = data["phases"][name]
        assert set(p) == PHASE_KEYS
        assert p["flops_per_call"] == flops
        assert p["clocks"] is None and p["samples"] is None
        windows = p["windows"]
        assert len(windows) >= 1
        assert p["window_s"] == pytest.approx(0.4 / sustained.MIN_WINDOWS)
        # the oracle: every rate recomputed from calls, FLOPs and seconds in the JSON
        burst = _tflops(p["burst"]["calls"], flops, p["burst"]["seconds"])
        assert p["burst"]["tflops"] == pytest.approx(burst, rel=1e-12)
        rates = [_tflops(w["calls"], flops, w["seconds"]) for w in windows]
        assert [w["tflops"] for w in windows] == pytest.approx(rates, rel=1e-12)
        last = rates[len(rates) // 2:]
        assert len(last) == math.ceil(len(rates) / 2) == p["sustained_windows"]
        assert p["sustained_tflops"] == pytest.approx(statistics.median(last), rel=1e-12)
        assert p["ratio"] == pytest.approx(statistics.median(last) / burst, rel=1e-12)
        # windows tile the sustained run: each ends where the next begins
        ends = [w["t_s"] for w in windows]
        assert ends == pytest.approx([sum(w["seconds"] for w in windows[:i + 1])
                                      for i in range(len(windows))], rel=1e-9)
    line = sustained.describe(data)
    assert "\n" not in line
    for name in ("gemm", "attention"):
        assert f"sustained/burst {data['phases'][name]['ratio']:.3f}" in line


def test_sustained_ratio_is_the_last_half_median_over_the_burst():
    windows = [{"tflops": t} for t in (9.0, 8.0, 7.0, 5.0, 6.0)]  # last ⌈5/2⌉: 7, 5, 6
    assert sustained.sustained_ratio(windows, 10.0) == pytest.approx(0.6)
    assert sustained.sustained_ratio(windows[:4], 10.0) == pytest.approx(0.6)  # 7, 5


def test_write_leaves_the_old_file_when_the_result_does_not_serialise(tmp_path):
    out = tmp_path / "s.json"
    out.write_text("old\n")
    with pytest.raises(TypeError):
        sustained.write({"phases": {1, 2}}, out)
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


@pytest.mark.parametrize("argv", [
    ["--seconds", "0"], ["--seconds", "nan"], ["--seconds", "soon"], ["--size", "4"],
    ["--idle", "-1"], ["--device", "tpu"], ["--out", "DIR"], ["--out"], [],
])
def test_bad_arguments_exit_2_with_one_line(argv, tmp_path, capsys):
    base = ["--out", str(tmp_path / "s.json"), "--device", "cpu"]
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    if argv and argv[0] == "--out":
        base = base[2:]
    full = base + argv if argv else ["--device", "cpu"]
    try:
        rc = sustained.main(full)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "s.json").exists()


def test_cuda_asked_for_without_one_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert sustained.main(["--out", str(tmp_path / "s.json"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device = 'cuda': no CUDA device here; use --device cpu\n"


def test_module_entry_point_bad_argument_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "calibration.microbench.sustained", "--out",
                           str(tmp_path / "s.json"), "--size", "0"], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr == "error: --size = 0: give N from 8 to 32768\n"


@pytest.mark.slow
def test_cpu_defaults_end_to_end(tmp_path):
    """The module as a command with the CPU's defaults (4 s a kernel)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "s.json"
    done = subprocess.run([sys.executable, "-m", "calibration.microbench.sustained", "--out",
                           str(out), "--device", "cpu"], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["settings"]["seconds"] == 4.0 and data["settings"]["size"] == 128
    # a window is a fixed number of calls sized before the run (no sync per call), so on
    # a loaded machine fewer fit the 4 s than MIN_WINDOWS: at least two, each with the
    # calls it was sized for, and the sustained figure the median of the last half
    for n in ("gemm", "attention"):
        phase = data["phases"][n]
        windows = phase["windows"]
        assert len(windows) >= 2
        assert len({w["calls"] for w in windows}) == 1
        assert phase["sustained_windows"] == len(windows) - len(windows) // 2


# ---------------------------------------------------------------- nvidia-smi sampling

FAKE_SMI = """#!/usr/bin/env bash
# a driver older than the rename: the new field name is refused
case "$*" in *clocks_event_reasons*)
  echo 'Field "clocks_event_reasons.active" is not a valid field to query.'; exit 2;; esac
trap 'exit 0' INT  # as nvidia-smi's loop ends on SIGINT
line() { echo "$(date '+%Y/%m/%d %H:%M:%S.%3N'), 1755, $1, 61, 0x0000000000000004"; }
case "$*" in
  *--loop-ms=*) while true; do line 690.25; sleep 0.05; done;;
  *) line '[N/A]';;
esac
"""


def test_sampler_falls_back_to_the_old_field_and_collects_samples(tmp_path):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(0o755)
    setup = sustained_smi.smi_command(object(), exe=str(exe))  # no uuid: index 0
    assert setup.error is None and setup.gpu == "0"
    assert setup.query == ",".join(sustained_smi.LEGACY_FIELDS)
    assert setup.command is not None and setup.command[-1] == "--loop-ms=200"
    sampler = sustained_smi.SmiSampler(setup.command)
    sampler.start()
    t0 = time.time()
    time.sleep(0.6)
    samples = sampler.stop()
    assert sampler._proc is not None and sampler._proc.poll() is not None  # it ended
    assert samples, "no sample parsed"
    assert {(s["sm_mhz"], s["power_w"], s["temp_c"], s["reasons"]) for s in samples} == {
        (1755.0, 690.25, 61.0, "0x0000000000000004")}
    summary = sustained_smi.summarise(samples, {"idle": t0 - 1, "burst": t0 - 0.5,
                                                "sustained": t0 - 0.4, "end": t0 + 10})
    assert summary["sustained"]["samples"] == len(samples)
    assert summary["sustained"]["sm_mhz"] == 1755.0
    assert summary["event_reasons"] == ["0x0000000000000004"]


def test_no_nvidia_smi_is_recorded_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    setup = sustained_smi.smi_command(object())
    assert setup.command is None and setup.error == "nvidia-smi not found"
    assert setup.describe()["error"] == "nvidia-smi not found"


def test_summarise_tags_parts_and_takes_medians():
    def s(t, mhz, watts, temp):
        return {"time": t, "sm_mhz": mhz, "power_w": watts, "temp_c": temp, "reasons": "0x0"}

    samples = [s(99.0, 100, 50, 30), s(100.5, 345, 80, 31), s(101.02, 1980, 300, 35),
               s(102, 1900, 700, 60), s(103, 1700, None, 70), s(104, 1800, 690, 65),
               s(200, 300, 90, 50)]
    summary = sustained_smi.summarise(samples, {"idle": 100.0, "burst": 101.0,
                                                "sustained": 101.5, "end": 110.0})
    assert [x["part"] for x in samples] == ["before", "idle", "burst", "sustained",
                                            "sustained", "sustained", "after"]
    assert samples[3]["t_s"] == 2.0
    assert summary["idle"] == {"samples": 1, "sm_mhz": 345, "power_w": 80, "temp_c_max": 31}
    assert summary["sustained"] == {"samples": 3, "sm_mhz": 1800, "power_w": 695.0,
                                    "temp_c_max": 70}
    assert summary["event_reasons"] == ["0x0"]


@pytest.mark.parametrize(("line", "expect"), [
    ("2026/12/07 05:00:00.250, 1980, 699.12, 55, 0x0", (1980.0, 699.12, 55.0)),
    ("2026/12/07 05:00:00.250, 1980, [N/A], [Not Supported], 0x0", (1980.0, None, None)),
    ("2026/12/07 05:00:00.250, [N/A], 90, 40, 0x0", None),  # no clock: no sample
    ("not csv at all", None),
])
def test_parse_line(line, expect):
    sample = sustained_smi.parse_line(line, 1.0)
    if expect is None:
        assert sample is None
    else:
        assert (sample["sm_mhz"], sample["power_w"], sample["temp_c"]) == expect
        assert sample["time"] != 1.0  # its own timestamp, not the arrival time


def test_describe_names_the_sustained_clock_and_a_phase_not_measured():
    phase = {"kernel": "8192³", "ratio": 0.9123, "burst": {"tflops": 700.0},
             "sustained_tflops": 638.6, "sustained_windows": 30, "windows": [{}] * 60,
             "clocks": {"sustained": {"sm_mhz": 1755.0, "power_w": 690.4}}}
    result = {"device_name": "NVIDIA H100 80GB HBM3", "dtype": "bf16",
              "settings": {"seconds": 60.0, "idle_s": 1.0},
              "phases": {"gemm": phase, "attention": None}}
    assert sustained.describe(result) == (
        "Sustained load on NVIDIA H100 80GB HBM3 (bf16, 60 s a kernel after 1 s idle): gemm "
        "8192³: sustained/burst 0.912 (burst 700, sustained 638.6 TFLOP/s, median of the last "
        "30 of 60 windows; SM clock 1755 MHz, 690 W (medians)); attention: not measured.")


def test_a_phase_with_the_sampler_tags_its_samples_by_part(tmp_path):
    """run_phase as on a GPU, with the stand-in nvidia-smi and the CPU's clock: samples
    come from the idle pause and the sustained run, each with its part and t_s."""
    import torch

    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(0o755)
    setup = sustained_smi.smi_command(object(), exe=str(exe))
    kernel = sustained.gemm_kernel("cpu", 32, torch.float32)
    phase = sustained.run_phase(kernel, sustained.Clock("cpu"), 0.8, 0.4, setup.command)
    parts = {s["part"] for s in phase["samples"]}
    assert {"idle", "sustained"} <= parts <= {"before", "idle", "burst", "sustained", "after"}
    clocks = phase["clocks"]
    assert clocks["sustained"]["samples"] == sum(s["part"] == "sustained"
                                                 for s in phase["samples"])
    assert clocks["sustained"]["sm_mhz"] == 1755.0
    ts = [s["t_s"] for s in phase["samples"]]
    assert ts == sorted(ts)

"""nvidia-smi in the background of :mod:`calibration.microbench.sustained`'s phases: SM
clock, power, temperature and the clock-event reasons every 200 ms, each sample tagged
with the part of the phase it fell in.

``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits --loop-ms=200`` (``-lms 200``;
the last field was ``clocks_throttle_reasons.active`` before drivers renamed it: the
query is tried with the new name, then the old). The GPU is named by its UUID where torch gives one
(CUDA's order and nvidia-smi's can differ), else by index 0. Each line's own timestamp
places it (the host's arrival time where that does not parse), so buffering in the pipe
does not move a sample. The sampler is stopped with SIGINT (nvidia-smi's loop ends and
flushes), then SIGTERM. Absent nvidia-smi, or a query it refuses, gives no sampler and
the reason.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu",
          "clocks_event_reasons.active")
LEGACY_FIELDS = (*FIELDS[:-1], "clocks_throttle_reasons.active")
SAMPLE_MS = 200
PARTS = ("idle", "burst", "sustained")


@dataclass(frozen=True)
class SmiSetup:
    """The sampling command (None where there is none) and why not."""

    command: list[str] | None
    query: str | None = None
    gpu: str | None = None
    error: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"query": self.query, "gpu": self.gpu, "sample_ms": SAMPLE_MS,
                "error": self.error}


def _gpu_ids(props: Any) -> list[str]:
    uuid = getattr(props, "uuid", None)
    text = str(uuid) if uuid is not None else ""
    ids = [text if text.startswith("GPU-") else f"GPU-{text}"] if text else []
    return [*ids, "0"]


def smi_command(props: Any, exe: str | None = None) -> SmiSetup:
    """The ``-lms`` command for the GPU of ``props`` (torch's device properties), once a
    one-shot query of the same fields has answered with a sample."""
    exe = exe or shutil.which("nvidia-smi")
    if exe is None:
        return SmiSetup(None, error="nvidia-smi not found")
    error = "no answer"
    for fields in (FIELDS, LEGACY_FIELDS):
        query = ",".join(fields)
        for gpu in _gpu_ids(props):
            base = [exe, "-i", gpu, f"--query-gpu={query}", "--format=csv,noheader,nounits"]
            try:
                done = subprocess.run(base, capture_output=True, text=True, timeout=20,
                                      check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return SmiSetup(None, error=f"{type(exc).__name__}: {exc}")
            lines = done.stdout.strip().splitlines()
            if done.returncode == 0 and lines and parse_line(lines[0], time.time()):
                stdbuf = shutil.which("stdbuf")
                return SmiSetup([*([stdbuf, "-oL"] if stdbuf else []), *base,
                                 f"--loop-ms={SAMPLE_MS}"], query, gpu)
            error = (done.stderr.strip() or done.stdout.strip() or
                     f"exit {done.returncode}").splitlines()[-1]
    return SmiSetup(None, error=error)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str, arrival: float) -> dict[str, Any] | None:
    """One CSV line of :data:`FIELDS` as a sample (epoch ``time``), or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        when = arrival
    sample = {"time": when, "sm_mhz": _number(parts[1]), "power_w": _number(parts[2]),
              "temp_c": _number(parts[3]), "reasons": parts[4]}
    return sample if sample["sm_mhz"] is not None else None


class SmiSampler:
    """``command`` (an ``-lms`` loop) in the background, its lines parsed as they come."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.samples: list[dict[str, Any]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return  # stop() then says: no samples
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_line(line, time.time())
            if sample:
                self.samples.append(sample)

    def stop(self) -> list[dict[str, Any]] | None:
        """End the loop; the samples (None where it never started)."""
        if self._proc is None:
            return None
        for send, wait_s in ((lambda p: p.send_signal(signal.SIGINT), 2.0),
                             (subprocess.Popen.terminate, 2.0), (subprocess.Popen.kill, 5.0)):
            if self._proc.poll() is None:
                send(self._proc)
            try:
                self._proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._thread is not None:
            self._thread.join(5.0)
        return self.samples


def _part(t: float, bounds: dict[str, float]) -> str:
    if t < bounds["idle"]:
        return "before"
    for part, end in zip(PARTS, ("burst", "sustained", "end"), strict=True):
        if t < bounds.get(end, float("inf")):
            return part
    return "after"


def summarise(samples: list[dict[str, Any]], bounds: dict[str, float]) -> dict[str, Any]:
    """Tag each sample with its part and seconds since the idle pause began (``t_s``);
    per part the samples' count, median SM MHz and watts and hottest °C, and the clock
    event reasons seen while sustained."""
    for s in samples:
        s["part"] = _part(s["time"], bounds)
        s["t_s"] = round(s["time"] - bounds["idle"], 3)
    out: dict[str, Any] = {}
    for part in PARTS:
        mine = [s for s in samples if s["part"] == part]
        mhz = [s["sm_mhz"] for s in mine if s["sm_mhz"] is not None]
        watts = [s["power_w"] for s in mine if s["power_w"] is not None]
        temps = [s["temp_c"] for s in mine if s["temp_c"] is not None]
        out[part] = {"samples": len(mine),
                     "sm_mhz": statistics.median(mhz) if mhz else None,
                     "power_w": statistics.median(watts) if watts else None,
                     "temp_c_max": max(temps) if temps else None}
    out["event_reasons"] = sorted({s["reasons"] for s in samples if s["part"] == "sustained"})
    return out

"""Timing one kernel honestly, on a CPU "device" or a CUDA GPU.

The rules (nanoGPT ``bench.py`` style): warm up first; time a batch of calls
between device synchronisations (CUDA events on GPU, ``time.perf_counter`` on
CPU); repeat the batch and keep the median, so one preempted batch does not move
the answer. Each call uses the next of a rotating set of freshly randomised input
buffers whose total exceeds the last-level cache, so a small kernel cannot run
from cache on data the previous call left there (capped at 32 sets: the smallest
kernels still see a warm cache, as they do in training when a producer kernel
just wrote their input).

A CPU "GPU" is one process with a fixed number of threads (``--threads``, one
by default) — the same device the measured CPU runs use.

torch is imported inside functions so that importing this module stays cheap.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from calibration.microbench.bench_shapes import GemmShape

from calibration.host import cpu_name, keep_freed_memory

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Budget:
    """How much measuring a calibration level buys; CPU and GPU levels differ in scale."""

    level: str  # tiny | quick | full
    device: str  # cpu | cuda
    max_gemm_flops: float  # model GEMMs above this are scaled down uniformly
    gemm_model_shapes: int
    gemm_grid_shapes: int
    attention_shapes: int
    memory_sizes: int  # per kernel
    max_memory_bytes: float
    coll_max_bytes: int
    target_s: float  # wall time aimed at per measurement (all repeats)
    min_reps: int = 5
    max_reps: int = 25  # cheap kernels get many samples: their median then shrugs off noise
    rounds: int = 3  # interleaved passes over a sweep; each point keeps its best pass
    recheck_passes: int = 2  # re-time compute points that read >15% slow (bench_compute)
    coll_steps_per_octave: int = 2  # message sizes per doubling (2: steps of √2)
    retry: int = 0  # > 0: a busy-machine re-measure, every compute job timed again
    # the GEMMs of ``calibrate --scenario``'s model (bench_shapes.scenario_gemm_shapes):
    # timed besides the bundled models' spread, every one of them
    scenario_gemms: tuple[GemmShape, ...] = ()

    @property
    def min_batch_s(self) -> float:
        """Shortest timed batch of back-to-back calls.

        On a CPU each call is timed on its own once it takes 0.2 ms or more: a
        preempted call then spoils one sample of many, not a whole batch. On a GPU
        calls run back to back between events, as kernels do in training.
        """
        return 2e-4 if self.device == "cpu" else 2e-3


def budget_for(device: str, level: str) -> Budget:
    if device == "cpu":
        return {
            "tiny": Budget("tiny", "cpu", 2.5e8, 14, 8, 6, 4, 16e6, 4 << 20, 0.04, 5, 51),
            "quick": Budget("quick", "cpu", 1e9, 28, 14, 10, 6, 64e6, 64 << 20, 0.1, 5, 101),
            "full": Budget("full", "cpu", 8e9, 64, 24, 24, 8, 256e6, 64 << 20, 0.4, 7, 201),
        }[level]
    return {
        "tiny": Budget("tiny", "cuda", 1e11, 16, 8, 8, 5, 256e6, 64 << 20, 0.02, 5, 25, 2, 1),
        "quick": Budget("quick", "cuda", 2e12, 40, 16, 16, 8, 2e9, 64 << 20, 0.05, 5, 25, 2, 1),
        "full": Budget("full", "cuda", 6e13, 120, 32, 40, 10, 8e9, 1 << 30, 0.2, 7, 31, 2, 1),
    }[level]


@dataclass
class Device:
    """Where kernels run: ``cpu`` (one process, ``threads`` threads) or ``cuda``."""

    kind: str
    threads: int = 1
    index: int = 0
    _torch: Any = field(default=None, repr=False)

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def setup(self) -> None:
        import torch

        self._torch = torch
        torch.set_num_threads(self.threads)
        if self.kind == "cpu":  # the measured CPU runs' allocator (calibration.host)
            keep_freed_memory()
        if self.kind == "cuda":
            torch.cuda.set_device(self.index)
            # PyTorch's default: fp32 matmuls stay fp32 (no TF32), as in the simulated runs
            torch.backends.cuda.matmul.allow_tf32 = False

    def sync(self) -> None:
        if self.kind == "cuda":
            self._torch.cuda.synchronize(self.index)

    def cache_bytes(self) -> int:
        """Last-level cache: the GPU's L2, or the CPU's largest cache (32 MiB if unknown)."""
        if self.kind == "cuda":
            props = self._torch.cuda.get_device_properties(self.index)
            return int(getattr(props, "L2_cache_size", 50 << 20))
        return cpu_llc_bytes()

    def free_bytes(self) -> int:
        if self.kind == "cuda":
            free, _ = self._torch.cuda.mem_get_info(self.index)
            return int(free)
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def cpu_llc_bytes() -> int:
    best = 0
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 << 20


def rotation_count(device: Device, bytes_per_set: float, cap_bytes: float) -> int:
    """How many input sets to rotate through: enough to overflow the cache, 2..32."""
    want = math.ceil(2 * device.cache_bytes() / max(bytes_per_set, 1.0))
    afford = int(cap_bytes // max(bytes_per_set, 1.0))
    return max(2, min(32, want, max(afford, 2)))


@dataclass(frozen=True)
class Timing:
    time_s: float  # median seconds per call
    reps: int  # timed batches
    calls_per_rep: int
    spread: float  # (p75 - p25) / median over batches, a noise indicator


def repeat_spread(samples: list[float], method: str = "exclusive") -> float:
    """(p75 − p25) / median of repeated timings, a noise indicator (0 for one sample)."""
    med = statistics.median(samples)
    if len(samples) < 2 or med <= 0:
        return 0.0
    q = statistics.quantiles(samples, n=4, method=method)  # type: ignore[arg-type]
    return (q[2] - q[0]) / med


def time_calls(device: Device, call: Callable[[int], object], nbuf: int,
               target_s: float, min_reps: int = 5, max_reps: int = 25,
               min_batch_s: float = 2e-3) -> Timing:
    """Median seconds of ``call(i)`` (i selects the rotating buffer set)."""
    for i in range(2):  # warm-up: allocator, lazy init, autotuning, page faults
        call(i % nbuf)
    device.sync()
    t0 = time.perf_counter()
    call(2 % nbuf)
    device.sync()
    est = max(time.perf_counter() - t0, 1e-7)
    k = max(1, math.ceil(min_batch_s / est))
    if device.kind == "cuda":
        k = min(k, MAX_QUEUED)
    reps = max(min_reps, min(max_reps, round(target_s / (k * est))))
    # the spin outlasts the host's issue of the batch: twice the first call's wall time
    # a call (an upper bound on its host part), at most 200 µs a call (a long kernel's
    # wall time is its device time, not the host's)
    lead_s = k * min(2.0 * est, 2e-4) + 2e-4
    samples = _batches(device, call, nbuf, k, reps, lead_s)
    return Timing(statistics.median(samples), reps, k, repeat_spread(samples))


#: most calls queued behind the spin kernel: CUDA's launch queue holds about a thousand
MAX_QUEUED = 512


def _spin_cycles(torch: Any, index: int, seconds: float) -> int:
    """GPU clock cycles that keep the device busy for ``seconds`` (the SM clock's rate,
    2 GHz where the properties do not say)."""
    khz = getattr(torch.cuda.get_device_properties(index), "clock_rate", 0) or 2_000_000
    return int(seconds * khz * 1e3)


def _batches(device: Device, call: Callable[[int], object], nbuf: int, k: int,
             reps: int, lead_s: float = 0.0) -> list[float]:
    """Per-call seconds of ``reps`` batches of ``k`` calls. On CUDA each batch is queued
    behind a spin kernel (``torch.cuda._sleep``) that lasts longer than the host takes
    to issue the batch, and timed from the spin's end: the device's time alone, kernels
    back to back with the launch gap between them, as in training where the host runs
    ahead. Timed from the host's issue instead, a tiny kernel reads the Python and
    dispatcher time of the benchmark loop (7-9 µs a call on an H200's host against the
    1.6 µs between queued kernels its training trace shows), which the simulator
    charges apart as the host cost."""
    torch = device._torch
    out: list[float] = []
    spin = (_spin_cycles(torch, device.index, lead_s)
            if device.kind == "cuda" and lead_s > 0 and hasattr(torch.cuda, "_sleep") else 0)
    gc_was = gc.isenabled()
    gc.disable()  # a collection in the middle of a batch is noise, not kernel time
    try:
        idx = 0
        for _ in range(reps):
            if device.kind == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                if spin:
                    torch.cuda._sleep(spin)
                start.record()
                for _ in range(k):
                    call(idx % nbuf)
                    idx += 1
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3 / k)
            else:
                t0 = time.perf_counter()
                for _ in range(k):
                    call(idx % nbuf)
                    idx += 1
                out.append((time.perf_counter() - t0) / k)
    finally:
        if gc_was:
            gc.enable()
    return out


def random_tensor(shape: tuple[int, ...], dtype: Any, device: str) -> Any:
    """Uniform(-1, 1): never zeros (zeros flatter some GPUs' power and clock behaviour)."""
    import torch

    return torch.empty(shape, dtype=dtype, device=device).uniform_(-1.0, 1.0)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def device_info(device: Device, nproc: int) -> dict[str, Any]:
    """Provenance: what was measured, with which software."""
    import torch

    info: dict[str, Any] = {
        "device": device.kind,
        "threads": device.threads,
        "nproc": nproc,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if device.kind == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device.index)
        info["device_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # NCCL absent from this build
            info["nccl"] = None
        info["backend"] = "nccl"
    else:
        info["device_name"] = cpu_name()
        info["cpu_count"] = os.cpu_count()
        info["allocator"] = keep_freed_memory()
        info["backend"] = "gloo"
    return info



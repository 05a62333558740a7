"""What both products share about the machine they run on: PyTorch itself
(:func:`require_torch`), the CPU's name (a CPU calibration's or a measured CPU run's
"device"), the ``PYTHONPATH`` torchrun's workers need, stopping a torchrun launch, the
host allocator a CPU "device" runs with (:func:`keep_freed_memory`), and the share of
the CPU a hypervisor took while something ran (:class:`StealMeter`).

Microbenchmarks (:mod:`calibration.microbench`) and measured runs
(:mod:`calibration.measured`) both launch workers with ``torchrun`` in a process
group of their own and both name the CPU they ran on; neither subpackage imports
the other for that.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

# The directory holding the ``calibration`` and ``simulator`` packages: torchrun's
# workers are started by module name (``-m calibration.measured.parallel_worker``)
# and must import them even from an uninstalled checkout.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def require_torch() -> Any:
    """``torch``, or a UserError saying how to install it (a command that measures needs it;
    the CLI and the fitter do not)."""
    from simulator.errors import Problem, UserError

    try:
        import torch
    except ImportError:
        raise UserError([Problem("", None, "calibration needs PyTorch: pip install "
                                 "'clustersim[calibrate]' (or torch)")]) from None
    return torch


def worker_pythonpath(env: dict[str, str] | None = None) -> str:
    """``PYTHONPATH`` for a torchrun launch: the package root, then what was set."""
    current = (os.environ if env is None else env).get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(PACKAGE_ROOT), current) if p)


def cpu_name() -> str:
    """The CPU's model name (a measured run's or a calibration's "device")."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine() or "cpu"


def kill_process_group(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> int:
    """Stop a launch's whole process group (torchrun and the workers it started):
    SIGTERM, then SIGKILL for what is left; returns the launcher's exit status."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # Workers that ignored SIGTERM may outlive the launcher: kill what is left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


#: glibc ``mallopt`` parameters (``malloc.h``): M_TRIM_THRESHOLD, M_MMAP_MAX
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: what :func:`keep_freed_memory` did, recorded beside CPU measurements and profiles
ALLOCATOR_NOTE = "glibc malloc keeps freed memory (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1)"


@functools.cache
def keep_freed_memory() -> str | None:
    """Make this process's allocator keep freed memory, as CUDA's caching allocator
    does on a GPU; returns :data:`ALLOCATOR_NOTE`, or None where glibc is not there.

    A CPU "device" allocates every tensor with glibc's ``malloc`` (PyTorch's CPU
    allocator caches nothing, ``c10/core/impl/alloc_cpu.cpp``). glibc serves blocks
    above its mmap threshold (128 KiB at start, ``mallopt(3)``) with a fresh
    ``mmap`` and gives them back on free, and trims the heap's top, so the next
    large tensor page-faults on first touch: on this project's VM a fresh 32 MiB
    buffer costs ~13 ms against 1.7 ms for the same copy into an existing one. A
    GPU's caching allocator (``c10/cuda/CUDACachingAllocator.cpp``) reuses freed
    blocks and pays none of that, and neither the simulator's cost model nor its
    memory model has such a cost. With ``M_MMAP_MAX`` 0 and no trimming, freed
    memory stays in the heap for the next tensor. Called by CPU calibration and
    CPU measured runs alike, before the first tensor, so both time the same host;
    applied once per process (later calls return what the first did).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return ALLOCATOR_NOTE if ok else None


#: the busy guard's limit on the hypervisor's share of the CPU (steal). On this
#: project's 2-vCPU VM (2026-12-03) it read 0–2% when calm and 25–37% in spells
#: (``vmstat``'s ``st``); five back-to-back tiny-gpt PP 2 GPipe runs measured 89.9,
#: 93.9, 96.9, 100.7 and 113.1 ms a step at 0.7, 2.6, 4.8, 5.5 and 5.9% steal: each
#: point of steal cost 2–5% of the step (two ranks on two vCPUs wait for whichever
#: the hypervisor stalls)
STEAL_LIMIT = 0.05


def cpu_times(stat: str | None = None) -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs since boot, from ``/proc/stat``'s ``cpu``
    line (``user nice system idle iowait irq softirq steal``; ``guest`` and
    ``guest_nice`` are already in ``user`` and ``nice``, see proc(5)); None where the
    file is missing (not Linux) or has no steal field (a kernel before 2.6.11)."""
    if stat is None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return None
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(x) for x in fields[1:9]]
            except ValueError:
                return None
            return (ticks[7], sum(ticks)) if len(ticks) == 8 else None
    return None


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the CPU time between two :func:`cpu_times` readings that the
    hypervisor gave to other guests (what ``top`` and ``vmstat`` call ``st``); None when
    either reading is missing or no tick passed."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(after[0] - before[0], 0) / (after[1] - before[1])


class StealMeter:
    """``with StealMeter() as m: ...`` then ``m.share``: the steal share over the block.

    On a virtual machine whose host is overcommitted, the hypervisor runs other guests
    on this VM's CPUs; every timing then reads slow, by an amount no repeat can average
    out when it lasts. The kernel counts those ticks, so a run can say how much of the
    machine it had instead of guessing from its timings' spread.
    """

    def __init__(self) -> None:
        self.before: tuple[int, int] | None = None
        self.share: float | None = None

    def __enter__(self) -> StealMeter:
        self.before = cpu_times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = steal_share(self.before, cpu_times())

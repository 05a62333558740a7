"""What both products share about the machine they run on: the CPU's name (a CPU
calibration's or a measured CPU run's "device"), the ``PYTHONPATH`` torchrun's
workers need, and stopping a torchrun launch.

Microbenchmarks (:mod:`calibration.microbench`) and measured runs
(:mod:`calibration.measured`) both launch workers with ``torchrun`` in a process
group of their own and both name the CPU they ran on; neither subpackage imports
the other for that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

# The directory holding the ``calibration`` and ``simulator`` packages: torchrun's
# workers are started by module name (``-m calibration.measured.parallel_worker``)
# and must import them even from an uninstalled checkout.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


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

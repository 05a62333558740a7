"""Progress bars: tqdm on stderr, only on a terminal, only for what takes a while.

Every long task of the CLI (the engine on a large workload, sweep points, plan
candidates and engine runs, uncertainty samples, validation rows, calibrate's benchmark
jobs, train's job runs and checkpoint scan) shows one of these. A bar appears only when
stderr is a terminal (``disable=None``), so logs and pipes get no control characters,
and only once its task has run :data:`BAR_DELAY_S` seconds, so a quick command prints
nothing extra.
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

#: Seconds a task runs before its bar appears: a quick one shows none.
BAR_DELAY_S = 2.0


def progress_bar(total: float, desc: str, unit: str = "") -> tqdm[Any]:
    """A tqdm bar on stderr, shown only when stderr is a terminal and only once the
    task has run :data:`BAR_DELAY_S` seconds."""
    return tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False,
                dynamic_ncols=True, mininterval=0.5, delay=BAR_DELAY_S)

"""Fixtures shared by test modules."""

from __future__ import annotations

import gc
import signal
from collections.abc import Iterator

import pytest


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection while a test sends itself SIGINT: a KeyboardInterrupt
    that lands inside a gc callback (hypothesis registers one, so after any hypothesis test
    in the same process) is swallowed as unraisable and the test sees no interruption (seen
    once in the full suite)."""
    was = gc.isenabled()
    gc.disable()
    # and SIGINT raising KeyboardInterrupt whatever the launcher left: a shell without job
    # control starts a background job with SIGINT ignored, which Python then keeps
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if was:
            gc.enable()


@pytest.fixture
def one_compute_speed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """NCCL's kernels holding no SMs (``Plan.sms`` 0): compute beside a collective runs at
    one speed, as the closed forms that are exact only then assume (the mechanism itself:
    tests/test_nccl_sms.py). The memoised slowing factors are dropped on both sides."""
    import simulator.system.collectives.choice as choice
    from simulator.strategies import timing

    timing._PRICED.clear()
    monkeypatch.setattr(choice, "with_channels", lambda plan, hw: plan)
    yield
    timing._PRICED.clear()

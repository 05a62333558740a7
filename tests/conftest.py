"""Fixtures shared by test modules."""

from __future__ import annotations

import gc
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
    try:
        yield
    finally:
        if was:
            gc.enable()

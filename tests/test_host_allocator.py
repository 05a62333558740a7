"""The CPU "device" allocator: freed memory is kept, as a GPU's caching allocator does.

A fresh large tensor under glibc's defaults is a new ``mmap`` whose first touch
page-faults on every page, every time; after :func:`calibration.host.keep_freed_memory`
the heap keeps what is freed, and once it holds the block, tensors of that size reuse
it without a fault. Counted in page faults
(``getrusage``), not timed: the count is what the setting changes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

_PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from calibration.host import keep_freed_memory
    note = keep_freed_memory() if sys.argv[1] == "keep" else None
    n = 32 * 2**20 // 4
    faults = []
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(n).fill_(1.0)   # touch every page of a fresh 32 MiB tensor
        del x
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*faults)
    print(note)
""")


def _faults(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()
    return out[1], [int(f) for f in out[0].split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_reused_without_page_faults() -> None:
    pages = 32 * 2**20 // 4096
    _, default = _faults("default")
    note, kept = _faults("keep")
    assert "M_MMAP_MAX=0" in note
    # glibc's default gives the block back: every repeat faults its pages again
    assert min(default) > pages // 2
    # kept: the heap grows until its free lists hold the block (posix_memalign's
    # alignment slack can skip a freed block a few times), then the repeats reuse it
    assert kept[0] > pages // 2
    assert max(kept[-8:]) < pages // 50

"""The one writer of output files: the destination checked first, the bytes written to
a temporary name beside it, renamed over it only when complete.

Every file the project writes (results, tables, figures, traces, cache entries,
profiles) goes through :func:`atomic_output`. Before anything is written, and
best before any long work (:func:`check_file_destination`), the destination is
resolved once and refused in one line, exit status 2, when
it cannot become a file:

- a name the file system cannot hold, ``~nosuchuser/...``
  (:func:`simulator.loading.local_path`, which readers share), a symlink loop;
- an existing directory or special file (a FIFO, a device) under that name;
- a path under an existing file, or a directory this process cannot write.

A write that fails on the way (``ENOSPC`` on a full disk, ``EDQUOT``, ``EIO``)
removes the temporary file, leaves whatever was under the final name as it was,
and is one line naming the path and the free space left there.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from simulator.errors import Problem, UserError
from simulator.loading import local_path


def _refuse(flag: str, path: object, fix: str) -> UserError:
    return UserError([Problem(flag, str(path), fix)])

def lookup(path: Path, flag: str) -> os.stat_result | None:
    """The entry's status following links (None: absent), or a one-line error."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a parent is a file: found by the walk up
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(flag, path, "is a symlink loop; give a real path") from None
        if exc.errno == errno.ENOENT or path.is_symlink():
            return None  # a dangling link: written through when the parent exists
        raise _refuse(flag, path, f"cannot be looked up ({exc.strerror or exc})") from None


def existing_ancestor(path: Path, flag: str) -> Path:
    """The nearest ancestor of ``path`` (``path`` excluded) that exists; a one-line
    error when it is not a directory."""
    parent = path.parent if path.parent != path else path
    while lookup(parent, flag) is None and parent.parent != parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _refuse(flag, path, f"lies under {parent}, which is a file, not a directory; "
                      "give another path")
    return parent


def probe_writable(directory: Path, flag: str, shown: Path) -> None:
    """Create and remove a file in ``directory``: the permission bits do not bind root,
    a read-only mount or a full quota does."""
    try:
        fd, name = tempfile.mkstemp(prefix=".clustersim-probe-", dir=directory)
        os.close(fd)
        Path(name).unlink()
    except OSError as exc:
        raise _refuse(flag, shown, f"cannot be written ({directory}: "
                      f"{exc.strerror or exc}); give another path") from None


def check_file_destination(path: str | os.PathLike[str], flag: str = "output") -> Path:
    """``path`` resolved, once it is sure a file can be written there; else a one-line
    :class:`UserError` naming ``flag``, the path and the fix."""
    target = local_path(path, flag)
    st = lookup(target, flag)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _refuse(flag, path, "is a directory; give a file name (e.g. DIR/name.csv)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _refuse(flag, path, "is a special file (a FIFO, socket or device), not a "
                      "regular file; give a file name")
    probe_writable(existing_ancestor(target, flag), flag, target)
    return target


def check_dir_destination(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """``path`` resolved, once it is sure a directory can be there and be written."""
    target = local_path(path, flag)
    if lookup(target, flag) is not None and not target.is_dir():
        raise _refuse(flag, path, f"is an existing file; choose another {flag}")
    probe_writable(target if target.is_dir() else existing_ancestor(target, flag), flag, target)
    return target


def free_space(path: Path) -> str:
    """The free space on ``path``'s file system, for a message ("12.0 MB free")."""
    here = path
    while not here.exists() and here.parent != here:
        here = here.parent
    try:
        free = shutil.disk_usage(here).free
    except OSError:
        return "free space unknown"
    return f"{free:,} bytes free there" if free < 10**7 else f"{free / 1e6:,.0f} MB free there"


def write_failed(path: Path, exc: OSError, flag: str = "output") -> UserError:
    """The one line for a write that failed part way (nothing was left under ``path``)."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"{reason}: {free_space(path)}"
    return _refuse(flag, path, f"could not be written ({reason}); nothing was written "
                   "under this name; free some space or give another path")


@contextmanager
def atomic_output(path: str | os.PathLike[str], flag: str = "output") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it over ``path``.

    The destination is checked first (:func:`check_file_destination`); on any
    exception the temporary file is removed and ``path`` is left as it was, and an
    ``OSError`` (a full disk) becomes a one-line :class:`UserError`.
    """
    target = check_file_destination(path, flag)
    # a fresh unique name, not mkstemp: mkstemp's file is mode 0600, and the output
    # should get the usual permissions (umask) like any other file the user writes
    tmp = target.with_name(f".{target.name[:200]}.{uuid.uuid4().hex}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        tmp.replace(target)
    except OSError as exc:
        raise write_failed(target, exc, flag) from None
    finally:
        tmp.unlink(missing_ok=True)


LOCK_WAIT_S = 60.0  # how long a second writer of the same directory waits for the first


@contextmanager
def output_lock(out: Path, flag: str = "--out", wait_s: float | None = None) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside the directory ``out`` (``fcntl.flock``) while its files
    are written: a second process writing the same directory waits up to ``wait_s``
    seconds (default :data:`LOCK_WAIT_S`), then refuses in one line naming the holder's
    pid. The lock file stays (a removed lock file races a waiting process); the OS
    releases the lock if the holder dies."""
    import fcntl
    import time

    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    lock = out.parent / f".{out.name[:200]}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise write_failed(lock, exc, flag) from None
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if time.monotonic() >= deadline:
                    raise _refuse(flag, out, f"another clustersim (pid {holder}) is still "
                                  f"writing there after {wait_s:g} s; wait for it to finish "
                                  "or give another path") from None
                if not told:
                    print(f"waiting for another clustersim (pid {holder}) writing to {out} "
                          "...", file=sys.stderr)
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock

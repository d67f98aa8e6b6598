"""One run per run directory, one writer per store: exclusive locks held while they work.

A run locks RUN_DIR/run.lock; a writer of a store (an import, a profile, a plan) locks
`.NAME.lock` beside it. Both are `flock`: the kernel releases it when the holding
process exits for any reason (a crash, `kill -9`, a lost machine's NFSv4 lease), so a
crashed run never leaves it stuck; a run that is alive keeps it, however long it takes.
While held, the file names its holder (host, pid, start time) for the refusal message.
RUN_DIR/run.lock is emptied on release; a store's `.NAME.lock` is removed (by its holder,
still holding it: a writer that locked a file removed meanwhile locks the new one), so
no write, finished or refused, leaves one behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from shardflow.errors import InputError

LOCK = "run.lock"


@contextlib.contextmanager
def _hold(path: Path, refusal, label: str = "", remove: bool = False) -> Iterator[Path]:
    """Hold an exclusive flock on `path` (created if need be), naming the holder (`label` first) in it while
    held; with `remove`, the file is removed on release (still held, so no one else locks it meanwhile)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a writer starting up"
            os.close(fd)
            raise InputError(refusal(holder)) from None
        if _still_at(fd, path):
            break
        os.close(fd)  # locked a file its last holder removed on release: lock the one at `path` now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{label}host {socket.gethostname()}, pid {os.getpid()}, since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode(), 0)
        yield path
    finally:
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            os.ftruncate(fd, 0)
        os.close(fd)


def _still_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the one named `path`."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold RUN_DIR's lock for the duration; InputError naming the holder if another run has it."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"run_dir {run_dir} is a file; accepted: a directory (new or of an earlier run)")
    run_dir.mkdir(parents=True, exist_ok=True)
    with _hold(run_dir / LOCK, lambda holder: (
        f"run_dir {run_dir} is in use by another run ({holder}); accepted: a run_dir no running run holds "
        "(wait for that run to end, or choose another run_dir). The lock goes when its process exits, "
        "also if it crashes."
    )) as path:
        yield path


def writer_lock_path(dest: str | Path) -> Path:
    dest = Path(dest)
    return dest.parent / f".{dest.name}.lock"


@contextlib.contextmanager
def writer_lock(dest: str | Path, label: str = "") -> Iterator[Path]:
    """Hold the lock of the store at `dest` (imports, profiles, plans) while writing it, or while a run trains
    on it (`label`: "run RUN_DIR: "): nothing is appended to a dataset a run reads.

    The lock is `.NAME.lock` beside the store, the same kind runs take: a second writer of
    the same store is refused naming the first, and never reports success for a store it
    did not write.
    """
    dest = Path(dest)
    if dest.parent.exists() and not dest.parent.is_dir():
        raise InputError(f"{dest}: its parent {dest.parent} is not a directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _hold(writer_lock_path(dest), lambda holder: (
        f"{dest} is held by another process ({holder}); accepted: one writer of a store at a time, and no "
        "append while a run trains on it (wait for it to end). The lock goes when its process exits, also if "
        "it crashes."
    ), label, remove=True) as path:
        yield path


@contextlib.contextmanager
def owned(dataset: str | Path, run_dir: str | Path) -> Iterator[None]:
    """Hold a dataset store's lock while a run of `run_dir` trains on it: an append is refused naming the run.

    A store whose directory cannot be written needs no lock: nothing can be appended to it.
    """
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(writer_lock(dataset, f"run {run_dir}: "))
        except PermissionError:
            pass
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
        yield

"""Build a store beside its destination, then swap it into place in one rename."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from shardflow.errors import InputError, stop_if_asked
from storage.manifest import MANIFEST, is_store

_LEFTOVER = re.compile(r"^\..+\.(staging|replaced)-[0-9a-f]{12}$")


def for_workers(path: str | Path) -> str:
    """A path as a Dask worker is given it: absolute, so that a worker started in another working directory (any
    cluster but a local one started here) reads and writes the files this process means."""
    return os.path.abspath(path)


def check_destination(dest: Path, *, overwrite: bool, reads: tuple[str | Path, ...] = ()) -> None:
    """Refuse, before any work, a destination that would lose data.

    Accepted: a path that does not exist, an empty directory, or (with overwrite) a
    shardflow store (storage.manifest.is_store: a damaged one too); never one of the stores or files the
    command `reads`, a directory holding one, a path inside one, a path inside another
    shardflow store (an overwrite of that store would take it along), or a symbolic link. Anything
    else is left alone.
    """
    dest = Path(dest)
    check_apart(dest, reads)
    outer = next((d for d in Path(os.path.abspath(dest)).parents if is_store(d)), None)
    if outer is not None:
        raise InputError(f"{dest}: a path inside the shardflow store {outer}; accepted: a path outside any store")
    if dest.is_symlink():  # the link, not its store, would be swapped out (and the store left behind)
        raise InputError(f"{dest}: a symbolic link to {os.readlink(dest)}; accepted: a path that is not a link "
                         f"(the store's own: {dest.resolve()})")
    if not dest.exists():
        if dest.parent.exists() and not dest.parent.is_dir():
            raise InputError(f"{dest}: its parent {dest.parent} is not a directory")
        return
    if not dest.is_dir():
        raise InputError(f"{dest} exists and is a file; accepted: a new path or a shardflow store with --overwrite")
    if not any(dest.iterdir()):
        return
    if not is_store(dest):  # a manifest.json of its own (a web app's) does not make it one: it was replaced
        raise InputError(
            f"{dest} exists, is not empty and is not a shardflow store; refusing to replace it. "
            "Accepted: a new path, an empty directory, or a shardflow store with --overwrite"
        )
    if not overwrite:
        raise InputError(f"{dest} already holds a store; pass --overwrite to replace it, or choose a new path")


def check_apart(dest: Path, reads: tuple[str | Path, ...], *, inside: bool = False) -> None:
    """Refuse a destination that is one of the paths a command reads, holds one, or (unless `inside`) lies
    inside one, links followed: replacing it, or writing into it, would change what is being read."""
    here = Path(dest).resolve()
    for source in reads:
        there = Path(source).resolve()
        where = "the same path as" if here == there else "a directory holding" if here in there.parents \
            else "a path inside" if there in here.parents and not inside else None
        if where is not None:
            raise InputError(f"{dest}: {where} {source}, which this command reads; accepted: a path outside it")


@contextlib.contextmanager
def staged(dest: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh staging directory; on success it replaces `dest`, on failure it is removed.

    The existing store at `dest` is untouched until the new one is complete (its
    manifest written). It is then moved aside, the new one renamed in, and the old one
    deleted. A process that was sent a stop signal publishes nothing, even if the
    signal's exception was lost on the way (shardflow.errors.stop_if_asked).
    """
    check_destination(Path(dest), overwrite=overwrite)
    dest = Path(os.path.abspath(dest))  # `.` has no name and no parent to stage in (renaming it failed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = dest.parent / f".{dest.name}.staging-{uuid.uuid4().hex[:12]}"
    try:
        stage.mkdir()  # inside: a signal right after it still removes the directory
        yield stage
        if not (stage / MANIFEST).is_file():
            raise RuntimeError(f"internal error: {stage} was staged without a {MANIFEST}")
        stop_if_asked()  # a stop whose exception a finalizer lost while the store was written: nothing published
        old = None
        if overwrite and dest.exists():
            old = dest.parent / f".{dest.name}.replaced-{uuid.uuid4().hex[:12]}"
            os.replace(dest, old)
        try:
            # Onto nothing or an empty directory only: if another writer's store got there
            # first, the rename fails instead of replacing it.
            os.rename(stage, dest)
        except OSError as e:
            if old is not None and not dest.exists():  # nothing took its place: the old store goes back
                os.replace(old, dest)
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise InputError(f"{dest}: another writer published a store there meanwhile; it is kept") from None
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        _remove(stage)
        raise


# zarr writes a chunk on its own IO thread: one in flight when an exception (a signal) stopped the writer lands
# after the stage is first removed, and makes its directories again. Such a write ends within milliseconds.
LATE_WRITE_S = 0.2


def _remove(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)
    time.sleep(LATE_WRITE_S)
    shutil.rmtree(stage, ignore_errors=True)


def remove_leftovers(directory: Path) -> list[str]:
    """Delete the staging and replaced stores a killed writer left in `directory`; their names.

    Only safe while no writer can be staging there: the retraining run calls it holding
    the run directory's lock. A leftover is never a complete store: a staged store
    becomes one only by the rename into place.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    gone = sorted(p.name for p in directory.iterdir() if _LEFTOVER.match(p.name) and p.is_dir())
    for name in gone:
        shutil.rmtree(directory / name, ignore_errors=True)
    return gone

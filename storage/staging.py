"""Build a store beside its destination, then swap it into place in one rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from shardflow.errors import InputError
from storage.manifest import MANIFEST


def check_destination(dest: Path, *, overwrite: bool) -> None:
    """Refuse, before any work, a destination that would lose data.

    Accepted: a path that does not exist, an empty directory, or (with overwrite) a
    directory holding a complete shardflow store. Anything else is left alone.
    """
    dest = Path(dest)
    if not dest.exists():
        if dest.parent.exists() and not dest.parent.is_dir():
            raise InputError(f"{dest}: its parent {dest.parent} is not a directory")
        return
    if not dest.is_dir():
        raise InputError(f"{dest} exists and is a file; accepted: a new path or a shardflow store with --overwrite")
    if not any(dest.iterdir()):
        return
    if not (dest / MANIFEST).is_file():
        raise InputError(
            f"{dest} exists, is not empty and is not a shardflow store; refusing to replace it. "
            "Accepted: a new path, an empty directory, or a shardflow store with --overwrite"
        )
    if not overwrite:
        raise InputError(f"{dest} already holds a store; pass --overwrite to replace it, or choose a new path")


@contextlib.contextmanager
def staged(dest: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh staging directory; on success it replaces `dest`, on failure it is removed.

    The existing store at `dest` is untouched until the new one is complete (its
    manifest written). It is then moved aside, the new one renamed in, and the old one
    deleted.
    """
    dest = Path(dest)
    check_destination(dest, overwrite=overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = dest.parent / f".{dest.name}.staging-{uuid.uuid4().hex[:12]}"
    stage.mkdir()
    try:
        yield stage
        if not (stage / MANIFEST).is_file():
            raise RuntimeError(f"internal error: {stage} was staged without a {MANIFEST}")
        old = None
        if dest.exists():
            old = dest.parent / f".{dest.name}.replaced-{uuid.uuid4().hex[:12]}"
            os.replace(dest, old)
        os.replace(stage, dest)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise

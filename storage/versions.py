"""Model versions of a run directory: one per run that found new data, and the promoted one.

    RUN_DIR/dataset                     the imported dataset, grown by appends night after night
    RUN_DIR/versions/NNNN/              one model version (0001, 0002, ...)
        version.json                    written when the version starts: the dataset segments it
                                        trains on, its training and evaluation windows, the version
                                        it warm-starts from and the configuration it was made with
        profile/ plan/ checkpoints/ model/ plots/
        result.json                     written last: its metrics, the gate's decision and the
                                        plan's; a version without it is unfinished
    RUN_DIR/current -> versions/NNNN    the promoted version (a symlink, switched atomically)

A version is finished by its result.json; the promotion (the switch of `current`) comes
after it, and is repeated by the next run if a kill fell in between. An unfinished
version is resumed by the next run (same data, same configuration) or made again (new
data or another configuration); the promoted version is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

VERSIONS, CURRENT = "versions", "current"
STARTED, RESULT = "version.json", "result.json"


def version_dir(run_dir: str | Path, number: int) -> Path:
    return Path(run_dir) / VERSIONS / f"{number:04d}"


def numbers(run_dir: str | Path) -> list[int]:
    """Every version that started, oldest first."""
    root = Path(run_dir) / VERSIONS
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and len(p.name) == 4
                  and (p / STARTED).is_file())


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def write_record(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def started(run_dir: str | Path, number: int) -> dict | None:
    return _read(version_dir(run_dir, number) / STARTED)


def result(run_dir: str | Path, number: int) -> dict | None:
    return _read(version_dir(run_dir, number) / RESULT)


def start(run_dir: str | Path, number: int, record: dict) -> Path:
    """Create version `number` (an unfinished one of that number is removed first)."""
    path = version_dir(run_dir, number)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    write_record(path / STARTED, {"version": number, **record})
    return path


def finish(run_dir: str | Path, number: int, record: dict) -> None:
    write_record(version_dir(run_dir, number) / RESULT, {"version": number, **record})


def current(run_dir: str | Path) -> int | None:
    """The promoted version, or None before the first promotion."""
    link = Path(run_dir) / CURRENT
    if not link.is_symlink():
        return None
    return int(Path(os.readlink(link)).name)


def promote(run_dir: str | Path, number: int) -> None:
    """Point `current` at version `number`: a new symlink renamed over the old one (atomic)."""
    link = Path(run_dir) / CURRENT
    tmp = link.with_name(f".{CURRENT}.{uuid.uuid4().hex[:8]}")
    os.symlink(f"{VERSIONS}/{number:04d}", tmp)
    os.replace(tmp, link)


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[int]:
    """Delete the checkpoints of every finished version but the newest `keep` and the promoted one."""
    finished = [n for n in numbers(run_dir) if result(run_dir, n) is not None]
    spared = set(finished[-keep:]) | {current(run_dir)}
    gone = []
    for n in finished:
        path = version_dir(run_dir, n) / "checkpoints"
        if n not in spared and path.exists():
            shutil.rmtree(path)
            gone.append(n)
    return gone

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
    RUN_DIR/promotions.json             an operator's promotions (rollbacks): who, when, why

A version is finished by its result.json; the promotion (the switch of `current`) comes
after it, and is repeated by the next run if a kill fell in between. An unfinished
version is resumed by the next run (same data, same configuration) or made again (new
data or another configuration); the promoted version is never touched.
"""

from __future__ import annotations

import getpass
import itertools
import json
import os
import re
import shlex
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from shardflow.errors import InputError
from shardflow.records import parse_record, plain
from storage.lock import LOCK
from storage.manifest import MANIFEST

VERSIONS, CURRENT = "versions", "current"
STARTED, RESULT = "version.json", "result.json"
PROMOTIONS = "promotions.json"
MAX_REASON_CHARS = 500  # an operator's why: kept whole in promotions.json and the promotion's event
# What an atomic write leaves behind when it is cut off: write_record's and promote's temporary names.
_TEMP = re.compile(r"^\.(.+\.json|current)\.[0-9a-f]{8}$")


@dataclass(frozen=True, kw_only=True)
class VersionStart:
    """A version's version.json, written when it starts: the dataset store and the checksums of the parts
    (segments) it trains on, their source names, the version it warm-starts from, its window (the first
    part trained on, the first evaluated on), the configuration's fingerprint and when it began."""

    version: int
    dataset: str
    segments: tuple[str, ...]
    warm_start_from: int | None
    window: tuple[int, ...]
    config: dict
    started: str
    parts: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Promotion:
    """One entry of promotions.json: an operator made `version` current (`previous` was), when the newest
    finished version was `newest_finished`; who, when (UTC, ISO 8601) and why."""

    version: int
    previous: int | None
    newest_finished: int
    by: str
    at: str
    reason: str


@dataclass(frozen=True)
class VersionPaths:
    """The stores of one model version (RUN_DIR/versions/NNNN), as the strings Prefect tasks take."""

    version: str
    profile: str
    plan: str
    model: str


@dataclass(frozen=True)
class RunLayout:
    """A run_dir's own stores and files; each model version's are `version(number)`."""

    run: Path

    @property
    def dataset(self) -> Path:
        return self.run / "dataset"

    @property
    def estimate(self) -> Path:  # the estimation run's scratch stores
        return self.run / "estimate"

    @property
    def worker_log(self) -> Path:  # the output of the run's local Dask workers (the last run's)
        return self.run / "dask-workers.log"

    def version(self, number: int) -> VersionPaths:
        path = version_dir(self.run, number)
        return VersionPaths(str(path), str(path / "profile"), str(path / "plan"), str(path / "model"))


def other_contents(run_dir: str | Path, shown: int = 3) -> list[str]:
    """The first `shown` names in `run_dir` when it holds entries but none a run writes (its dataset, versions,
    current version, lock, workers' log, estimation stores): a directory of something else, where a run would
    mix its stores with another's files. [] for a new or empty directory or a run's."""
    run = Path(run_dir)
    layout = RunLayout(run)
    ours = (layout.dataset, layout.estimate, layout.worker_log, run / VERSIONS, run / CURRENT, run / LOCK)
    if not run.is_dir() or any(p.exists() or p.is_symlink() for p in ours):
        return []
    return sorted(p.name for p in itertools.islice(run.iterdir(), shown))


def lists_dir(run_dir: str | Path, number: int) -> Path:
    """Where version `number`'s night writes its top-K lists (storage.recommendations)."""
    return version_dir(run_dir, number) / "recommendations"


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


def write_record(path: Path, record: dict | list) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def new_parts(run_dir: str | Path, record: VersionStart) -> tuple[str, ...]:
    """The parts version `record` trains on that no earlier version of the run_dir had (a cold start: all of
    them), whichever run imported them: a version cut off and made again by a later run names them too."""
    earlier = [started(run_dir, n) for n in numbers(run_dir) if n < record.version]
    seen = {p for began in earlier if began is not None for p in began.parts}
    return tuple(p for p in record.parts if p not in seen)


def started(run_dir: str | Path, number: int) -> VersionStart | None:
    """Version `number`'s start record (None: no such version); an InputError naming a bad field."""
    path = version_dir(run_dir, number) / STARTED
    record = _read(path)
    return None if record is None else parse_record(VersionStart, record, str(path))


def began(run_dir: str | Path, number: int) -> VersionStart:
    """The start record of version `number`, which exists; an InputError naming the file when it does not."""
    record = started(run_dir, number)
    if record is None:
        raise InputError(f"{version_dir(run_dir, number) / STARTED}: missing; accepted: the start record of a "
                         "version a run began")
    return record


def result(run_dir: str | Path, number: int) -> dict | None:
    return _read(version_dir(run_dir, number) / RESULT)


def start(run_dir: str | Path, record: VersionStart) -> Path:
    """Create version `record.version` (an unfinished one of that number is removed first)."""
    path = version_dir(run_dir, record.version)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    write_record(path / STARTED, plain(record))
    return path


def restart(run_dir: str | Path, record: VersionStart) -> None:
    """Rewrite unfinished version `record.version`'s start record (a resume under another topology), keeping
    everything it holds."""
    write_record(version_dir(run_dir, record.version) / STARTED, plain(record))


def finish(run_dir: str | Path, number: int, record: dict) -> None:
    write_record(version_dir(run_dir, number) / RESULT, {"version": number, **record})


def current(run_dir: str | Path) -> int | None:
    """The promoted version, or None before the first promotion; an InputError if `current` is not a link
    to a finished version (a dangling or hand-made link), naming the command that mends it."""
    link = Path(run_dir) / CURRENT
    if not link.is_symlink() and not link.exists():
        return None
    target = os.readlink(link) if link.is_symlink() else "(not a link)"
    name = Path(target).name
    if link.is_symlink() and Path(target).parent.name == VERSIONS and name.isdigit() and len(name) == 4 \
            and result(run_dir, int(name)) is not None:
        return int(name)
    finished = [n for n in numbers(run_dir) if result(run_dir, n) is not None]
    raise InputError(
        f"{link} points at {target!r}, not a finished model version; accepted: a link to one, made by "
        f"shardflow promote {shlex.quote(str(run_dir))} --version N (finished versions: "
        f"{', '.join(map(str, finished)) or 'none'})"
    )


def current_recommendations(run_dir: str | Path) -> tuple[int, list[Path]]:
    """The current version and the complete recommendations stores ranked by it, newest night first (a night
    writes its lists after the gate, from the model current then; a rollback writes none); an InputError saying
    why there are none."""
    from storage import recommendations

    if not Path(run_dir).is_dir():
        raise InputError(f"run_dir {run_dir}: no such directory; accepted: a run directory of 'shardflow run'")
    stores = [s for s in (lists_dir(run_dir, n) for n in reversed(numbers(run_dir))) if (s / MANIFEST).is_file()]
    if not stores:
        made = ", ".join(map(str, numbers(run_dir))) or "none"
        raise InputError(f"run_dir {run_dir} holds no top-K lists (versions: {made}); accepted: a run_dir after a "
                         "night that wrote them (nightly.top_k > 0, a sequence model without event features)")
    now = current(run_dir)
    ranked_by = {s: recommendations.read(s)["version"] for s in stores}  # each manifest read once
    mine = [s for s in stores if ranked_by[s] == now]
    if now is None or not mine:
        raise InputError(f"run_dir {run_dir}: no top-K lists ranked by the current version {now} (the newest, "
                         f"{stores[0]}, are version {ranked_by[stores[0]]}'s); accepted: a run_dir after a night "
                         "under the current version (the next night writes its lists)")
    return now, mine


def lists_cut_off(run_dir: str | Path, last: int | None, top_k: int) -> bool:
    """Whether finished version `last`'s night was cut off before it wrote its top-K lists (a night writes them
    after the gate, from the model current then): top_k > 0, no complete store under the version, and a current
    model that writes lists. The next run writes them."""
    now = current(run_dir)
    if not top_k or last is None or now is None or result(run_dir, last) is None:
        return False
    if (lists_dir(run_dir, last) / MANIFEST).is_file():
        return False
    from storage import recommendations  # pyarrow: not for the nights that have their lists
    from storage.checkpoint import read_export_manifest

    return recommendations.why_none(read_export_manifest(version_dir(run_dir, now) / "model").model) is None


def promote(run_dir: str | Path, number: int) -> None:
    """Point `current` at version `number`: a new symlink renamed over the old one (atomic)."""
    link = Path(run_dir) / CURRENT
    tmp = link.with_name(f".{CURRENT}.{uuid.uuid4().hex[:8]}")
    os.symlink(f"{VERSIONS}/{number:04d}", tmp)
    os.replace(tmp, link)


def promotions(run_dir: str | Path) -> list[Promotion]:
    """An operator's promotions of `run_dir`, oldest first; an InputError naming a bad entry."""
    path = Path(run_dir) / PROMOTIONS
    records = _read(path)
    if records is None:
        return []
    if not isinstance(records, list):
        raise InputError(f"{path}: a {type(records).__name__}; accepted: a JSON list of promotions")
    return [parse_record(Promotion, r, f"{path} entry {i + 1}") for i, r in enumerate(records)]


def promote_by_operator(run_dir: str | Path, number: int, reason: str) -> Promotion:
    """Make finished version `number` current at an operator's word, and record who, when and why.

    The record names the newest finished version: a run never re-promotes it or an older one
    (see promotion_cut_off); a version begun before the rollback is made again from it.
    """
    if number not in numbers(run_dir) or result(run_dir, number) is None:
        finished = [n for n in numbers(run_dir) if result(run_dir, n) is not None]
        raise InputError(f"version {number} of {run_dir} is not a finished model version; accepted: "
                         + (f"one of {', '.join(map(str, finished))}" if finished else
                            "a finished version, and none has finished yet"))
    try:
        before = current(run_dir)
    except InputError:
        before = None  # a damaged link is what this mends
    newest = max(n for n in numbers(run_dir) if result(run_dir, n) is not None)
    record = Promotion(version=number, previous=before, newest_finished=newest, by=getpass.getuser(),
                       at=datetime.now(UTC).isoformat(timespec="seconds"), reason=reason)
    write_record(Path(run_dir) / PROMOTIONS, [plain(p) for p in [*promotions(run_dir), record]])
    promote(run_dir, number)
    return record


def rollback(run_dir: str | Path, number: int, reason: str) -> Promotion:
    """An operator's promotion as the CLI and the rollback deployment make it: under the run_dir's lock
    (never under a running night), of a version whose export verifies; the record (promote_by_operator)."""
    from storage.checkpoint import verify_export
    from storage.lock import run_lock

    check_reason(reason)
    if not (Path(run_dir) / VERSIONS).is_dir():
        raise InputError(f"run_dir {run_dir} holds no model versions; accepted: a run_dir of 'shardflow run'")
    with run_lock(run_dir):
        if number in numbers(run_dir) and result(run_dir, number) is not None:
            verify_export(version_dir(run_dir, number) / "model")
        return promote_by_operator(run_dir, number, reason)


def check_reason(reason: str) -> None:
    """An operator's why: one line of 1 to MAX_REASON_CHARS characters (the CLI prints it in a line; 5,000
    characters were taken and recorded)."""
    if not reason.strip() or len(reason) > MAX_REASON_CHARS or not reason.isprintable():
        shown = f"of {len(reason):,} characters" if len(reason) > MAX_REASON_CHARS else repr(reason)
        raise InputError(f"reason {shown}; accepted: one line of 1 to {MAX_REASON_CHARS} printable characters")


def promotion_cut_off(run_dir: str | Path, last: int | None) -> bool:
    """Whether finished version `last` was accepted but `current` never switched to it (a kill between its
    result and the switch), and no operator has promoted another version since it was made."""
    finished = None if last is None else result(run_dir, last)
    if finished is None or not finished["promoted"] or current(run_dir) == last:
        return False
    return not any(p.newest_finished >= last for p in promotions(run_dir))


def sweep_temporary(run_dir: str | Path) -> list[str]:
    """Delete what cut-off atomic writes left in `run_dir` and its versions (under the run's lock); their paths."""
    run_dir = Path(run_dir)
    places = [run_dir, *(version_dir(run_dir, n) for n in numbers(run_dir))]
    places += [p / "plan" for p in places[1:]]
    gone = []
    for place in places:
        if place.is_dir():
            for p in place.iterdir():
                if _TEMP.match(p.name) and (p.is_symlink() or p.is_file()):
                    p.unlink()
                    gone.append(str(p.relative_to(run_dir)))
    return gone


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

"""A model version's lifecycle, without Prefect: whether a run has anything new to train, which version it makes
(a new one, or one cut off part-way, resumed or made again), the window of parts it trains on, and the
fingerprint of a configuration. tasks/versions.py runs it as the open-version task.

The layout and its records are storage.versions; docs/runs.md says what each decision means for a user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import Any

from shardflow.config import RetrainConfig
from shardflow.data.clicks import training_window_start
from shardflow.errors import TrainingError
from shardflow.importing import import_options, imported_source, same_source, source_parts, source_warnings
from shardflow.planner.topology import parse_topology
from shardflow.reporting.run_report import version_result
from shardflow.reporting.summary import RunSummary
from storage import staging, versions
from storage.checkpoint import complete_checkpoints, sweep_retired
from storage.dataset import Dataset
from storage.importers import check_continuation
from storage.lock import run_lock
from storage.manifest import MANIFEST
from storage.versions import STARTED, VersionStart

# Keys that change nothing a version computes: a version cut off part-way is resumed
# under any of their values, and made again when any other key changed.
NOT_FINGERPRINTED = ("run_dir", "scheduler_address", "cluster_class", "cluster_kwargs", "tls_ca_file", "tls_cert",
                     "tls_key", "max_restarts", "restart_timeout_s", "promotion_margin", "keep_versions",
                     "keep_checkpoints",
                     "part_settle_s")


def fingerprint(config: RetrainConfig) -> dict[str, Any]:
    values = {k: v for k, v in config.flat().items() if k not in NOT_FINGERPRINTED}
    values["topology"] = config.parsed_topology.to_dict()
    return values


def nothing_new(config: RetrainConfig) -> RunSummary | None:
    """The run's summary, read from the stores alone, when it would train nothing; else None.

    Nothing new: the newest version is finished (promoted, if it was accepted, and its top-K
    lists written) and was made from every part the dataset holds, or would hold after this
    run's append. A run that finds that needs no Prefect API and no Dask cluster; anything
    else (a new part, a version to resume, a promotion or lists to repeat) goes through the
    whole flow.
    """
    run = config.run_dir
    if not versions.numbers(run):
        return None
    with run_lock(run):  # a run_dir another run holds is refused, as ever, naming the holder
        return _nothing_new(config, run)


def _nothing_new(config: RetrainConfig, run: str) -> RunSummary | None:
    last = versions.numbers(run)[-1]
    finished = versions.result(run, last)
    if finished is None or versions.promotion_cut_off(run, last) \
            or versions.lists_cut_off(run, last, config.nightly.top_k):
        return None
    source, dest = Path(config.data.dataset), config.layout.dataset
    warnings = []
    if (source / MANIFEST).is_file():
        store = source
    else:
        known = imported_source(config)
        if known is None or not same_source(known, config):
            return None
        parts = source_parts(config, known)
        if check_continuation(config.data.dataset_format, source, dest, parts, known, import_options(config)):
            return None
        warnings, store = source_warnings(source, parts), dest
    segments = [s.checksum for s in Dataset.open(store).segments]
    if versions.began(run, last).segments != tuple(segments):
        return None
    return untrained(run, versions.current(run), last, (), tuple(warnings))


def untrained(run: str, current: int | None, newest: int, parts_added: tuple[str, ...],
              warnings: tuple[str, ...]) -> RunSummary:
    """A run that found no new data: the current version's figures, nothing trained, nothing downloaded.

    `newest` is the last version made, which saw every part: the current one, or a later one that was
    not promoted."""
    figures = version_result(run, current) if current else None
    if figures is None:
        raise TrainingError(f"run_dir {run} has no promoted model version and no new data to make one from")
    nothing = dataclasses.replace(figures.training, downloads=0, epoch_loss=(), resumed_from=None,
                                  skipped_checkpoints=(), restarts=0)
    return dataclasses.replace(
        figures, trained=False, parts_added=parts_added, current=current, training=nothing, warnings=warnings,
        newest_version=newest, message=f"no new data since version {newest}: nothing trained")


@dataclass(frozen=True)
class NothingNew:
    """What open-version finds when the dataset holds nothing the versions have not seen: the current
    version, the newest one made (it saw every part) and how many parts there are."""

    current: int | None
    newest: int
    parts: int


def open_version(config: RetrainConfig, dataset: str, log: Logger | LoggerAdapter[Logger]) -> VersionStart | NothingNew:
    """What this run does: NothingNew when the dataset holds nothing the versions have not seen, else the
    start record of the version to make (a new one, or one cut off part-way, resumed or made again).

    A trained version's training window starts after the parts its warm-start source saw
    (config.nightly.train_window widens it); its held-out items are those of the new parts.
    """
    run = config.run_dir
    ds = Dataset.open(dataset)
    segments = [s.checksum for s in ds.segments]
    made = versions.numbers(run)
    last = made[-1] if made else None
    finished = versions.result(run, last) if last else None
    if last is not None and versions.promotion_cut_off(run, last):
        versions.promote(run, last)  # a run cut off between the version's result and its promotion
        log.warning("version %d was accepted but its promotion was cut off; promoted now", last)
    promoted = versions.current(run)
    if last is not None and finished is not None and versions.began(run, last).segments == tuple(segments):
        log.info("no new data since version %d: nothing to train", last)
        return NothingNew(promoted, last, len(segments))
    mark = fingerprint(config)
    number = (last or 0) + 1
    if last is not None and finished is None:
        resumed = _resume_cut_off(run, last, segments, mark, promoted, log)
        if resumed is not None:
            return resumed
        number = last
    window = _training_window(config, ds, segments, promoted, log)
    record = VersionStart(
        version=number, dataset=str(Path(dataset).resolve()), segments=tuple(segments),
        parts=tuple(p["name"] for p in ds.info.source.get("parts", [])) if isinstance(ds.info.source, dict) else (),
        warm_start_from=promoted, window=tuple(window), config=mark,
        started=datetime.now(UTC).isoformat(timespec="seconds"))
    versions.start(run, record)
    log.info("version %d: %s, training on parts %d..%d", number,
             f"warm start from version {promoted}" if promoted else "cold start", window[0] + 1, len(segments))
    return record


def _resume_cut_off(run: str, last: int, segments: list[str], mark: dict[str, Any], promoted: int | None,
                    log: Logger | LoggerAdapter[Logger]) -> VersionStart | None:
    """Version `last`, cut off part-way, resumed as it began or on a new plan of the devices there are now; None
    when it must be made again (new data, another configuration, another current version), said in the log."""
    began, parts = versions.began(run, last), tuple(segments)
    if (began.segments, began.config, began.warm_start_from) == (parts, mark, promoted):
        log.info("resuming version %d, cut off part-way", last)
        return began
    if (began.segments, began.warm_start_from) == (parts, promoted) \
            and _other_devices(began.config, mark) and complete_checkpoints(versions.version_dir(run, last)):
        before, now = began.config["topology"], mark["topology"]
        log.warning("version %d was cut off part-way and the topology changed (%d devices → %d): resuming it "
                    "from its last checkpoint on a new plan", last, parse_topology(before, STARTED).devices,
                    parse_topology(now, "the run's topology").devices)
        began = dataclasses.replace(began, config=mark)
        versions.restart(run, began)
        return began
    why = "new data arrived" if began.segments != parts else "the configuration changed" \
        if began.config != mark else f"version {promoted} was made current since it began"
    log.warning("version %d was cut off part-way and %s: making it again", last, why)
    return None


def _training_window(config: RetrainConfig, ds: Dataset, segments: list[str], promoted: int | None,
                     log: Logger | LoggerAdapter[Logger]) -> list[int]:
    """[the first part trained on, the first part evaluated on]: after the parts the warm-start source saw
    (those its dataset shares with this one: a part replaced since with 'shardflow import --replace-from' is
    new to it), widened by config.nightly.train_window, and to one batch of examples at least."""
    seen = common_prefix(versions.began(config.run_dir, promoted).segments, segments) if promoted else 0
    window = config.nightly.train_window
    wanted = {"new": seen, "all": 0}[window] if isinstance(window, str) else max(0, len(segments) - window)
    train_from = training_window_start(ds, wanted, config.train.batch_size, seen,
                                       validation=config.train.patience is not None)
    if train_from < wanted:
        log.info("the window from part %d holds less than one batch of %d examples: widened to part %d",
                              wanted + 1, config.train.batch_size, train_from + 1)
    return [train_from, seen]


def _other_devices(began: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two fingerprints differ in the topology alone: a version goes on from its checkpoint on a new plan
    of the devices there are now."""
    return began["topology"] != now["topology"] and {k: v for k, v in began.items() if k != "topology"} == {
        k: v for k, v in now.items() if k != "topology"}


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading entries `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def remove_leftovers(run_dir: str | Path) -> list[str]:
    """Remove the unfinished stores a cut-off run left behind (the caller holds the run's lock); their names.

    Called at a run's start and again at its end: workers of a killed run finish the
    write they were in (a second or so) and may leave a few files after the first sweep.
    """
    run = Path(run_dir)
    return staging.remove_leftovers(run) + staging.remove_leftovers(run / "checkpoints") + sweep_retired(run) + (
        versions.sweep_temporary(run) if (run / versions.VERSIONS).is_dir() else [])

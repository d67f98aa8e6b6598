"""A run's source and the dataset store it trains on: which store that is, what the source directory holds, and
the import (or append) that brings a night's new parts into RUN_DIR/dataset.

`dataset` is either a store (grown, if at all, by 'shardflow import --append') or a source (a file or a
directory of daily parts) imported into RUN_DIR/dataset; shardflow.preflight refuses, before anything is
written, a source that does not continue the one the run_dir imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import Any

from shardflow.config import RetrainConfig
from shardflow.errors import DamagedStore, InputError, OtherFormat
from storage.dataset import Dataset
from storage.importers import import_dataset, recorded_options, repair_command
from storage.manifest import MANIFEST
from storage.sources import Part, not_parts, resolve_parts, unfinished


@dataclass(frozen=True)
class Imported:
    """The dataset store a run trains on, the names of the parts it added, and what it warned of."""

    path: str
    parts_added: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def dataset_store(config: RetrainConfig) -> Path | None:
    """The dataset store the run trains on as it is now: `dataset` if it is a store, else RUN_DIR/dataset once
    something was imported into it (None before the first import)."""
    source, dest = Path(config.data.dataset), config.layout.dataset
    return source if (source / MANIFEST).is_file() else dest if (dest / MANIFEST).is_file() else None


def imported_source(config: RetrainConfig) -> dict[str, Any] | None:
    """The source RUN_DIR/dataset was imported from (None: `dataset` is a store itself, or nothing imported yet)."""
    source, dest = Path(config.data.dataset), config.layout.dataset
    if (source / MANIFEST).is_file() or not (dest / MANIFEST).is_file():
        return None
    return Dataset.open(dest).info.source


def import_options(config: RetrainConfig) -> dict[str, Any]:
    """The options an import records: criteo's table sizes, recbole's click label (none for the other formats)."""
    return recorded_options(config.data.dataset_format, {}, config.data.hash_rows, config.data.click_label)


def import_kwargs(config: RetrainConfig) -> dict[str, Any]:
    data = config.data
    return {"hash_rows": data.hash_rows} if data.dataset_format == "criteo" else {"label": data.click_label}


def same_source(known: dict[str, Any], config: RetrainConfig) -> bool:
    return (known.get("format"), known.get("path")) == (config.data.dataset_format, str(Path(config.data.dataset)))


def source_parts(config: RetrainConfig, known: dict[str, Any] | None) -> list[Part]:
    """The parts of the dataset directory, each unfinished one marked (those RUN_DIR/dataset holds are not judged)."""
    held = [p["name"] for p in known.get("parts", [])] if known and same_source(known, config) else []
    return resolve_parts(config.data.dataset, config.data.part_settle_s, held)


def source_warnings(source: Path, parts: list[Part]) -> list[str]:
    """What a run tells about its source directory: entries that are not parts, parts left for a later night."""
    out = []
    for what, names in ((f"skipped {{}} entries of {source} that are not parts", not_parts(source)),
                        (f"left {{}} parts of {source} for a later night (not finished)", unfinished(parts))):
        if names:
            out.append(what.format(len(names)) + ": " + ", ".join(names[:5]) + (", …" if len(names) > 5 else ""))
    return out


def verify_dataset(store: Path) -> None:
    """Hash every array of the dataset store a run trains on, every run: a chunk changed in place leaves the
    manifest as it was. A damaged segment stops the run with the command that rebuilds it from its part."""
    ds = Dataset.open(store, hashed=False)
    try:
        ds.verify()
    except DamagedStore as e:
        segment = -1 if e.segment is None else e.segment  # -1: no part named, a whole re-import
        raise InputError(f"{e}. To rebuild it from its part: {repair_command(ds.info.source, segment, store)}") \
            from None


@contextmanager
def naming_the_format_key(config: RetrainConfig) -> Iterator[None]:
    """A source line that reads as another format is refused naming the run's key that chooses it, `dataset_format`
    (a flat key of `--set` and of a deployment's config), not only the format."""
    try:
        yield
    except OtherFormat as e:
        raise InputError(f"{e}; this run's dataset_format is {config.data.dataset_format!r}: set "
                         f"dataset_format={e.other}") from None


def bring_in(config: RetrainConfig, log: Logger | LoggerAdapter[Logger]) -> Imported:
    """The dataset store and the parts this run added to it.

    `dataset` itself if it is a store, else its import into RUN_DIR/dataset. A source
    the run_dir imported before gets its new finished parts appended (the append refuses,
    under the store's lock, parts that vanished or changed); shardflow.preflight.check_run
    has refused another source on a run_dir with model versions. The warnings, logged,
    name what the source holds that is not a part, and the parts left for a later night
    because they may still be being written.
    """
    source, dest = Path(config.data.dataset), config.layout.dataset
    if (source / MANIFEST).is_file():
        verify_dataset(source)
        return Imported(str(source))
    known = imported_source(config)
    warnings = tuple(source_warnings(source, source_parts(config, known)))
    for w in warnings:
        log.warning("%s", w)
    if known is not None and same_source(known, config):
        verify_dataset(dest)  # before the append: its new parts are hashed as they are written
        with naming_the_format_key(config):
            added = import_dataset(config.data.dataset_format, source, dest, append=True,
                                   settle_s=config.data.part_settle_s, **import_kwargs(config)).parts_added
        log.info("%s %s (imported from %s)", f"appended {len(added)} parts to" if added else "reusing", dest, source)
        return Imported(str(dest), tuple(Path(p).name for p in added), warnings)
    with naming_the_format_key(config):
        done = import_dataset(config.data.dataset_format, source, dest, overwrite=(dest / MANIFEST).is_file(),
                              settle_s=config.data.part_settle_s, **import_kwargs(config))
    return Imported(str(dest), tuple(Path(p).name for p in done.parts_added), warnings)

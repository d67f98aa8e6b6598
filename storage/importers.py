"""Import published dataset files into a dataset store: streamed, part by part, appendable.

An import runs three phases over the parts it adds:

    scan    (storage.scan) per part (in parallel on Dask when there are several): read it block by
            block, parse each block with arrow, collect every column's distinct raw values and
            spill the events' raw values (or codes) to the staging directory
    number  (storage.segments) in part order: the values a part introduces get the next rows of their table,
            in sorted order; new users get the next indices the same way (storage.idmap)
    write   (storage.segments) per part (in parallel): map the spilled values to rows, regroup by user and
            time where the format needs it (recbole), write the part's segment chunk by chunk

Memory holds one block, the distinct values and the runs (not the events), except for a
format regrouped by time (recbole), which holds its sort keys for one part. A fresh import
is staged beside its destination and renamed into place; an append writes new segments
and then the manifest. Either holds the store's writer lock (storage.lock), so a failed
or concurrent import leaves the store as it was.
"""

from __future__ import annotations

import os
import shlex
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from shardflow.errors import InputError, stop_if_asked
from storage.checksum import file_sha256
from storage.dataset import Dataset
from storage.dataset_manifest import FORMAT_VERSION, KIND, MADE_BY, SEGMENTS, Segment, record_verified
from storage.dataset_writer import build_manifest, segment_name, start_store
from storage.formats import (
    FEATURE_FILES,
    FORMATS,
    Format,
    Recbole,
    feature_files,
    make_format,
    parse_click_label,
    read_features,
    sniff_delimiter,
)
from storage.idmap import MAX_HASH_ROWS, IdMap
from storage.lock import writer_lock
from storage.manifest import MANIFEST, read_manifest, write_manifest
from storage.scan import PartScan, scan_part
from storage.segments import Numberer, Numbering, as_numpy, write_segment
from storage.sources import (
    BLOCK_BYTES,
    Part,
    PartReader,
    finished,
    require_finished,
    resolve_parts,
    same_file,
    unfinished,
)
from storage.staging import check_apart, check_destination, for_workers, staged
from storage.tables import TableSpec

DEFAULT_HASH_ROWS = 1 << 20
EXACT = "exact"  # a criteo table size: a row per distinct value (rows grow with appends), not hashed


def _check_options(fmt: str, table_rows: dict[str, int], hash_rows: int, label: str | None) -> None:
    if fmt not in FORMATS:
        raise InputError(f"format {fmt!r} is not known; accepted: {', '.join(FORMATS)}")
    if label is not None:
        if fmt != "recbole":
            raise InputError(f"--label {label!r} for format {fmt!r}; accepted: a click label only for recbole "
                             "(criteo and avazu logs carry their own)")
        parse_click_label(label)
    if fmt != "criteo" and (table_rows or hash_rows != DEFAULT_HASH_ROWS):
        given = [f"--table-rows {k}={v}" for k, v in table_rows.items()]
        given += [f"--hash-rows {hash_rows}"] if hash_rows != DEFAULT_HASH_ROWS else []
        raise InputError(f"{' '.join(given)} for format {fmt!r}; accepted: table sizes only for criteo (its hashed "
                         "columns)")
    for name, rows in [*table_rows.items(), ("--hash-rows", hash_rows)]:
        if rows != EXACT and (isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_HASH_ROWS):
            raise InputError(f"{name}: {rows!r} rows; accepted: an integer from 1 to {MAX_HASH_ROWS:,} (hashed into "
                             f"that many rows; row ids are int32), or {EXACT!r} (a row per distinct value)")


def _first_line(part: Part) -> bytes:
    for block in PartReader(part, 1 << 16).blocks():
        return block.data[: block.data.find(b"\n")]
    return b""


@dataclass(frozen=True)
class ImportResult:
    """What an import did: the store's manifest as it wrote it (or found it), the paths of the parts it read
    and of those the store held already, and the unfinished parts it left for later, each with why."""

    manifest: dict
    parts_added: tuple[str, ...]
    parts_skipped: tuple[str, ...] = ()
    parts_waiting: tuple[str, ...] = ()


def import_dataset(
    fmt: str,
    src: str | Path,
    dest: str | Path,
    *,
    overwrite: bool = False,
    append: bool = False,
    table_rows: dict[str, int] | None = None,
    hash_rows: int = DEFAULT_HASH_ROWS,
    client=None,
    block_bytes: int = BLOCK_BYTES,
    settle_s: float = 0.0,
    replace_from: str | None = None,
    label: str | None = None,
) -> ImportResult:
    """Import `src` (a file, a .gz file or a directory of parts) in format `fmt` into the store `dest`.

    With `append`, only the parts `dest` does not hold yet are added, as a new version;
    without it `dest` must be new (or `overwrite` given). With `replace_from` (a part name
    the store holds), that part and every later one are read again from `src`, as a new
    version of the store: the way out when a part changed after it was imported. Only
    finished parts are read (storage.sources.resolve_parts, with `settle_s`). With `label`
    (recbole only, `rating>=4`), the interactions become a click log (storage.formats.Recbole).
    With a Dask
    `client`, the parts are scanned and written in parallel on its workers.
    """
    src, dest = Path(src), Path(dest)
    table_rows = dict(table_rows or {})
    _check_options(fmt, table_rows, hash_rows, label)
    options = recorded_options(fmt, table_rows, hash_rows, label)
    if overwrite and (append or replace_from):
        raise InputError("--overwrite with --append or --replace-from; accepted: one of them")
    resolve_parts(src)  # a source that is not there is refused before the store is locked
    check_apart(dest, (src,), inside=True)  # a store in a directory of parts is not read as a part (files only)
    with writer_lock(dest):
        held = [p["name"] for p in read_manifest(dest, KIND, FORMAT_VERSION, MADE_BY)["source"].get("parts", [])] \
            if (append or replace_from) and (dest / MANIFEST).is_file() else []
        parts = resolve_parts(src, settle_s, held)
        waiting = tuple(unfinished(parts))
        if replace_from is not None:
            done = _replace(fmt, src, dest, parts, replace_from, options, client, block_bytes)
        elif append and (dest / MANIFEST).is_file():
            manifest = read_manifest(dest, KIND, FORMAT_VERSION, MADE_BY)
            done = _append(fmt, src, dest, parts, manifest, options, client, block_bytes)
        else:
            done = _fresh(fmt, src, dest, require_finished(src, parts), overwrite, options, client, block_bytes)
        return replace(done, parts_waiting=waiting)


def _fresh(fmt, src, dest, parts, overwrite, options, client, block_bytes) -> ImportResult:
    check_destination(dest, overwrite=overwrite)
    with staged(dest, overwrite=overwrite) as stage:
        start_store(stage)
        manifest = _import_parts(fmt, src, stage, parts, None, options, client, block_bytes)
        write_manifest(stage, manifest)
        record_verified(stage)
    return ImportResult(manifest, tuple(str(p.path) for p in parts))


def check_continuation(fmt: str, src: Path, dest: Path, parts: list[Part], source: dict, options: dict) -> list[Part]:
    """The finished parts of `src` that the store at `dest` (whose manifest records `source`) does not hold yet.

    `parts`: every part of `src` (storage.sources.resolve_parts). Nothing is written.
    Refused, naming what differs: another format or table sizes, a part the store holds
    that is gone or whose content changed, a new part that sorts before the last one held.
    """
    if source.get("format") != fmt:
        raise InputError(f"{dest} holds a {source.get('format')} import; accepted: --format {source.get('format')}")
    if source.get("options", {}) != options:
        raise InputError(f"{dest} was imported with {source.get('options', {})}; accepted: the same options "
                         f"({_option_flags(source.get('options', {})).strip() or 'none'})")
    on_disk = {p.name: p for p in parts}
    known = {p["name"]: p for p in source["parts"]}
    for name, recorded in known.items():
        part = on_disk.get(name)
        if part is None:
            raise InputError(
                f"{src}: part {name!r} of {dest} (version {recorded['version']}) is gone; accepted: a source "
                "holding every part the store was given, plus new ones"
            )
        if not same_file(part, recorded) and file_sha256(part.path) != recorded["sha256"]:
            raise InputError(
                f"{part.path}: part {name!r} changed since version {recorded['version']} imported it "
                f"({recorded['sha256'][:19]}…); accepted: parts that are never rewritten (add a new part instead). "
                f"To take the part as it is now: shardflow import --format {fmt}{_option_flags(options)} "
                f"--replace-from {shlex.join([name, str(src), str(dest)])}"
            )
    new = [p for p in finished(parts) if p.name not in known]
    if not new or not known:
        return new
    last = max(known)
    early = [p.name for p in new if p.name < last]
    if early:
        raise InputError(
            f"{src}: new part {early[0]!r} sorts before {last!r}, already imported; accepted: new parts named "
            "after the last one imported (parts are read in name order, one per day say)"
        )
    return new


def recorded_options(fmt: str, table_rows: dict, hash_rows, label: str | None) -> dict:
    """What a store's manifest records of an import's options: criteo's table sizes, recbole's click label."""
    if fmt == "criteo":
        return {"table_rows": table_rows, "hash_rows": hash_rows}
    return {"label": label} if label is not None else {}


def repair_command(source: dict, segment: int, dest: str | Path) -> str:
    """The command that rebuilds segment `segment` of the store at `dest` from its part, as its `source` record
    (format, options, path, parts) names them; a whole re-import where the record does not name the part."""
    fmt, options, parts = source.get("format"), source.get("options", {}), source.get("parts", [])
    flags = _option_flags(options) if isinstance(options, dict) else ""
    src = str(source.get("path", "SOURCE"))
    if 0 <= segment < len(parts) and isinstance(parts[segment], dict) and "name" in parts[segment]:
        return (f"shardflow import --format {fmt}{flags} --replace-from "
                f"{shlex.join([str(parts[segment]['name']), src, str(dest)])}")
    return f"shardflow import --format {fmt}{flags} --overwrite {shlex.join([src, str(dest)])}"


def _option_flags(options: dict) -> str:
    """The command-line flags that give an import `options` (criteo's table sizes, recbole's click label)."""
    if "label" in options:
        return f" --label {shlex.quote(options['label'])}"
    if not options:
        return ""
    rows = "".join(f" --table-rows {t}={n}" for t, n in sorted(options.get("table_rows", {}).items()))
    return f" --hash-rows {options['hash_rows']}{rows}"


def _append(fmt, src, dest, parts, manifest, options, client, block_bytes) -> ImportResult:
    new = check_continuation(fmt, src, dest, parts, manifest["source"], options)
    skipped = tuple(str(p.path) for p in finished(parts) if p not in new)
    if not new:
        return ImportResult(manifest, (), skipped)
    segments_dir = dest / SEGMENTS
    listed = {s["name"] for s in manifest["segments"]}
    for leftover in segments_dir.iterdir():  # segments a cut-off append wrote but never published
        if leftover.name not in listed:
            shutil.rmtree(leftover, ignore_errors=True)
    stage = dest / SEGMENTS / f".append.staging-{uuid.uuid4().hex[:12]}"
    try:
        updated = _import_parts(fmt, src, stage, new, (Dataset.open(dest), manifest), options, client, block_bytes)
        stop_if_asked()
        for s in updated["segments"][len(manifest["segments"]):]:
            os.replace(stage / SEGMENTS / s["name"], segments_dir / s["name"])
        write_manifest(dest, updated)
        record_verified(dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ImportResult(updated, tuple(str(p.path) for p in new), skipped)


def _replace(fmt, src, dest, parts, name, options, client, block_bytes) -> ImportResult:
    """Replace the store's part `name` and every later one by what `src` holds now (under the writer lock).

    The parts before `name` must be unchanged. The new store is staged beside `dest`: the
    segments kept are hard links (copies where links cannot be made), the parts from
    `name` on are imported again, and the result is swapped in with one rename. Every
    raw id and user the replaced segments introduced keeps its row and index (the first
    new segment carries them), so model versions trained before stay valid for the rows
    they hold. The manifest's source records the replacement ("replaced").
    """
    if not (dest / MANIFEST).is_file():
        raise InputError(f"--replace-from {name}: {dest} holds no store yet; accepted: a store to import into")
    manifest = read_manifest(dest, KIND, FORMAT_VERSION, MADE_BY)
    source = manifest["source"]
    names = [p["name"] for p in source.get("parts", [])]
    if name not in names:
        raise InputError(f"--replace-from {name}: not a part {dest} holds; accepted: one of {', '.join(names)}")
    k = names.index(name)
    if name not in {p.name for p in finished(parts)}:
        raise InputError(f"--replace-from {name}: {src} holds no finished part {name!r}; accepted: a finished "
                         "part (ending with a newline, settled, or with its NAME.done marker)")
    kept = {**manifest, "segments": manifest["segments"][:k], "source": {**source, "parts": source["parts"][:k]}}
    early = check_continuation(fmt, src, dest, [p for p in parts if p.name < name], kept["source"], options)
    if early:
        raise InputError(f"{src}: new part {early[0].name!r} sorts before {name!r}, which is replaced; accepted: "
                         "new parts named after the last one imported")
    again = [p for p in finished(parts) if p.name >= name]
    with staged(dest, overwrite=True) as stage:
        start_store(stage)
        for s in kept["segments"]:
            shutil.copytree(dest / SEGMENTS / s["name"], stage / SEGMENTS / s["name"], copy_function=_link)
        ds = Dataset.open(dest)
        existing = (ds, kept, ds.segments[k:])
        updated = _import_parts(fmt, src, stage, again, existing, options, client, block_bytes)
        updated["source"]["replaced"] = source.get("replaced", []) + [{
            "part": name, "segment": k, "version": updated["version"],
            "sha256_before": source["parts"][k]["sha256"], "sha256_after": updated["source"]["parts"][k]["sha256"],
        }]
        write_manifest(stage, updated)
        record_verified(stage)
    return ImportResult(updated, tuple(str(p.path) for p in again), tuple(str(p.path) for p in parts if p.name < name))


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _import_parts(fmt_name, src, stage: Path, parts, existing, options, client, block_bytes) -> dict:
    """Scan, number and write `parts` into `stage`/segments; the manifest of the result (not written).

    `existing`: None (a fresh store), or (the store, its manifest) to continue, or (the
    store, its manifest cut before the parts replaced, the segments replaced).
    """
    fmt, features, hash_rows = _prepared_format(fmt_name, src, parts[0], options,
                                                None if existing is None else existing[0].info.widths)
    version = 1 if existing is None else existing[1]["version"] + 1
    first_index = 0 if existing is None else len(existing[1]["segments"])
    spill_root = stage / "spill"
    read = [p if client is None else replace(p, path=Path(for_workers(p.path))) for p in parts]
    scans = _each(client, scan_part, [(fmt, p, for_workers(spill_root / segment_name(first_index + i)), hash_rows,
                                       block_bytes) for i, p in enumerate(read)])
    numberer = _numberer(fmt, existing, hash_rows)
    numberings = [numberer.number(first_index + i, s) for i, s in enumerate(scans)]
    if existing is not None and len(existing) == 3:
        _carry(existing[0], existing[2], numberings[0], fmt)
    rows = {t: m.size for t, m in numberer.tables.items()}
    (stage / SEGMENTS).mkdir(parents=True, exist_ok=True)
    segments = _each(client, write_segment, [(fmt, s, n, for_workers(stage / SEGMENTS / segment_name(n.index)), version,
                                              rows) for s, n in zip(scans, numberings, strict=True)])
    shutil.rmtree(spill_root, ignore_errors=True)
    tables = {t: {"rows": max(1, rows[t]), "dtype": str(TableSpec(t, max(1, rows[t])).id_dtype),
                  **({"hashed": "crc32"} if t in hash_rows else {}),
                  **({"width": fmt.widths[t]} if t in fmt.widths else {})} for t in fmt.tables}
    return build_manifest(
        version=version, users=numberer.user_count, tables=tables, sequence_table=fmt.sequence_table,
        dense=fmt.dense, labels=fmt.labels, source=_source(fmt, src, scans, segments, version, existing, options,
                                                           features),
        segments=(existing[1]["segments"] if existing else []) + segments,
    )


def _prepared_format(fmt_name: str, src: Path, first_part: Part, options: dict,
                     stored_widths: dict | None) -> tuple[Format, dict, dict]:
    """The format of an import, its header read from the first part and a click log's feature files joined
    (their token sequences as wide as `stored_widths`, a store's, if given); the feature files read
    (path -> FeatureFile) and the hashed tables' sizes."""
    fmt = make_format(fmt_name, options.get("label"))
    features = {}
    if fmt.labels and isinstance(fmt, Recbole):
        features = {p: read_features(p, FEATURE_FILES[suffix]) for suffix, p in feature_files(src).items()}
        fmt.join(tuple(features.values()))
    first = _first_line(first_part)
    sniff_delimiter(fmt, first)
    if fmt.has_header:
        fmt.header(first_part.path, first)
    if features and stored_widths is not None:
        fmt.fit_widths(stored_widths)
    sizes = {t: options["table_rows"].get(t, options["hash_rows"]) for t in fmt.tables} if "hash_rows" in options \
        else {}
    unknown = [t for t in options.get("table_rows", {}) if t not in fmt.tables]
    if unknown:
        raise InputError(f"--table-rows {unknown[0]}: no such categorical column; accepted: {', '.join(fmt.tables)}")
    return fmt, features, {t: rows for t, rows in sizes.items() if rows != EXACT}


def _each(client, fn, calls: list[tuple]) -> list:
    """fn(*call) for every call, in order: in parallel on the Dask `client` when there are several. A stop
    signal is taken up before each call here, even if its exception was lost (shardflow.errors.stop_if_asked)."""
    if client is not None and len(calls) > 1:
        stop_if_asked()
        return _gather(client, [client.submit(fn, *call, pure=False) for call in calls])
    results = []
    for call in calls:
        stop_if_asked()
        results.append(fn(*call))
    return results


def _source(fmt: Format, src: Path, scans: list[PartScan], segments: list[dict], version: int, existing,
            options: dict, features: dict) -> dict:
    """The manifest's record of where the store came from: every part it holds, the options, the feature files."""
    added = [{"name": s.part.name, "sha256": s.sha256, "bytes": s.part.bytes, "mtime_ns": s.part.mtime_ns,
              "lines": s.lines, "events": s.events, "segment": seg["name"], "version": version}
             for s, seg in zip(scans, segments, strict=True)]
    held = existing[1]["source"]["parts"] if existing else []
    source = {"format": fmt.name, "path": str(src), "parts": held + added}
    if options:
        source["options"] = options
    if features:  # what this version joined (the files may grow with later parts)
        source["features"] = [{"name": p.name, "sha256": file_sha256(p), "fields": list(f.fields),
                               "skipped": list(f.skipped)} for p, f in features.items()]
    return source


def _carry(ds: Dataset, dropped: tuple[Segment, ...], first: Numbering, fmt: Format) -> None:
    """Give the first segment of a replacement the raw ids and users the `dropped` segments introduced,
    ahead of its own new ones, so each keeps the row and user index it had."""
    def ahead(stored: np.ndarray, new) -> np.ndarray:
        stored = stored.astype(object) if stored.dtype.kind == "T" else stored  # zarr's strings, numpy's
        return np.concatenate([stored, as_numpy(new)]) if len(stored) else new

    for t in fmt.tables:
        raw, rows = ds.segment_raw_ids(dropped, t)
        new_raw, new_rows = first.new_raw[t]
        first.new_raw[t] = (ahead(raw, new_raw), np.concatenate([rows, np.asarray(new_rows, dtype=np.int64)]))
    if first.new_users is not None:
        first.new_users = ahead(ds.segment_user_ids(dropped), first.new_users)


def _numberer(fmt: Format, existing, hash_rows: dict[str, int]) -> Numberer:
    text_users = fmt.name == "recbole"
    grouped_or_coded = not fmt.labels  # a click log's examples are each their own user
    if existing is None:
        users = IdMap.empty(text_users) if grouped_or_coded else None
        tables = {t: IdMap.empty(fmt.name in ("recbole", "criteo"), hash_rows.get(t)) for t in fmt.tables}
        return Numberer(users, tables, 0)
    ds = existing[0]
    if set(ds.info.table_names) != set(fmt.tables):
        raise InputError(f"the new parts have tables {list(fmt.tables)}; the store has {ds.info.table_names}")
    users = None
    if grouped_or_coded:
        raw = ds.user_ids()
        users = IdMap(raw, np.arange(len(raw), dtype=np.int64))
    tables = {}
    for t in fmt.tables:
        raw, rows = ds.raw_ids(t)
        tables[t] = IdMap(raw, rows, hash_rows=hash_rows.get(t))
    if grouped_or_coded or len(existing) == 2:
        return Numberer(users, tables, ds.info.users)
    # every example its own user (held by no model): a replacement numbers them on from the segments kept
    return Numberer(users, tables, sum(s["new_users"] for s in existing[1]["segments"]))


def _gather(client, futures) -> list:
    """Results of `futures` in order; the first failure (an InputError naming a part) is raised."""
    from distributed import wait

    wait(futures)
    for f in futures:
        if f.status == "error":
            raise f.exception()
    return client.gather(futures)


"""Manifests: the last file written into a store, and the proof that it is complete."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardflow.errors import InputError

MANIFEST = "manifest.json"


OPENING = '{\n  "format": "shardflow.'  # how every manifest shardflow writes begins (write_manifest)
MAX_READ_BYTES = 1 << 26  # a manifest.json larger than this is told by its opening alone


def write_manifest(store: Path, manifest: dict) -> None:
    """Write `manifest` into `store` durably: a temporary file, fsync, then an atomic rename. Its format first, so
    it begins with OPENING (is_store)."""
    path = Path(store) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": manifest["format"], **manifest}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_store(path: Path) -> bool:
    """Whether `path` is a shardflow store, whole or damaged: its manifest.json a JSON object of a shardflow format,
    or one that does not parse but begins as shardflow writes one (cut short: a damaged checkpoint a resume skipped
    is replaced). A web app's or a browser extension's manifest.json is neither."""
    manifest = Path(path) / MANIFEST
    try:
        if manifest.stat().st_size <= MAX_READ_BYTES:
            found = json.loads(manifest.read_bytes())
            return isinstance(found, dict) and str(found.get("format", "")).startswith("shardflow.")
    except OSError:
        return False
    except ValueError:  # not JSON (cut short?): how it begins tells
        pass
    try:
        with open(manifest, "rb") as f:
            head = f.read(len(OPENING)).decode(errors="replace")
    except OSError:
        return False
    if len(head) < len(OPENING):  # cut short within its opening (empty: nothing tells)
        return bool(head) and OPENING.startswith(head)
    return head == OPENING


def read_manifest(store: Path, kind: str, version: int, made_by: str, name: str = MANIFEST) -> dict:
    """The manifest of a `kind` store at `store` (in its file `name`), or an InputError saying why it is not one."""
    store = Path(store)
    path = store / name
    if not store.is_dir():
        what = "a file, not a directory" if store.exists() else "no such directory"
        raise InputError(f"{store}: {what}; accepted: a {kind} store written by {made_by}")
    if not path.is_file():
        raise InputError(
            f"{store} is not a complete {kind} store: it has no {name} (a write that did not "
            f"finish leaves none); accepted: a {kind} store written by {made_by}"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); accepted: a manifest written by {made_by}") from None
    expected = f"shardflow.{kind}"
    if not isinstance(manifest, dict) or manifest.get("format") != expected:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InputError(f"{path}: format is {found!r}; accepted: {expected!r}")
    if manifest.get("format_version") != version:
        raise InputError(
            f"{path}: format_version is {manifest.get('format_version')!r}; accepted: {version}"
        )
    return manifest

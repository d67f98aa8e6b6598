"""The recommendations store: each user's top-K items from one model, as Parquet files any reader can open.

Layout (under a model version, RUN_DIR/versions/NNNN/recommendations):

    part-NNNNN.parquet   one per block of users, written by the worker that scored it:
                         user (string, the raw id), rank (int32, from 1), item (string, the
                         raw id), score (float32, the model's logit); a user's rows in rank order
    manifest.json        written last: the model and dataset they come from, k, the users, and
                         every file's rows and sha256

Read it with pandas (`pandas.concat(map(pandas.read_parquet, files))`) or pyarrow on the files
the manifest lists (`files`). Raw ids are written as strings whatever their type in the
source, so a user's id reads back as it was spelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardflow.errors import InputError
from storage.checksum import file_sha256
from storage.manifest import read_manifest, write_manifest

KIND = "recommendations"
FORMAT_VERSION = 1
MADE_BY = "'shardflow run'"
SCHEMA = pa.schema([("user", pa.string()), ("rank", pa.int32()), ("item", pa.string()), ("score", pa.float32())])


def why_none(model: dict[str, Any]) -> str | None:
    """Why the model of an export's record `model` writes no lists (a click log's, or one with event features), or
    None (a record kept before click logs trained holds a sequence model without a kind)."""
    if model.get("kind", "sequence") != "sequence":
        return "a click-log model (a click log's rows are labelled events, not items to rank for a user)"
    if model.get("features"):
        return (f"a model with event features {list(model['features'])} (a list for tomorrow cannot know tomorrow's "
                "event features)")
    return None


def write_part(stage: str | Path, index: int, users: np.ndarray, items: np.ndarray, scores: np.ndarray) -> dict:
    """Write one block of users' lists (raw user ids [U], raw item ids [U, K] as strings, scores [U, K]; an
    empty string where a user has fewer than K items) as part `index`; {file: {"rows", "sha256"}}."""
    k = items.shape[1]
    keep = items != ""
    table = pa.table({
        "user": pa.array(np.broadcast_to(users[:, None], items.shape)[keep], pa.string()),
        "rank": pa.array(np.broadcast_to(np.arange(1, k + 1, dtype=np.int32), items.shape)[keep]),
        "item": pa.array(items[keep], pa.string()),
        "score": pa.array(scores[keep].astype(np.float32)),
    }, schema=SCHEMA)
    name = f"part-{index:05d}.parquet"
    path = Path(stage) / name
    pq.write_table(table, path)
    return {name: {"rows": table.num_rows, "sha256": file_sha256(path)}}


def finish(stage: str | Path, record: dict, files: dict) -> dict:
    """The manifest, written last: `record` says what the lists are of (model, dataset, k, users)."""
    manifest = {"format": f"shardflow.{KIND}", "format_version": FORMAT_VERSION, **record,
                "files": dict(sorted(files.items()))}
    write_manifest(Path(stage), manifest)
    return manifest


def read(path: str | Path) -> dict:
    """The manifest of a complete recommendations store."""
    return read_manifest(Path(path), KIND, FORMAT_VERSION, MADE_BY)


def files(path: str | Path) -> list[Path]:
    """The Parquet files of the store at `path`, in order (what pandas or pyarrow reads)."""
    return [Path(path) / name for name in read(path)["files"]]


def find(path: str | Path, user: str) -> list[tuple[str, float]] | None:
    """(raw item id, score) of `user`'s list, best first; None if the store has no list for it."""
    for f in files(path):
        table = pq.read_table(f, filters=[("user", "=", user)])
        if table.num_rows:
            order = np.argsort(table.column("rank").to_numpy())
            items = table.column("item").to_pylist()
            scores = table.column("score").to_numpy()
            return [(items[i], float(scores[i])) for i in order]
    return None


def missing(path: str | Path, user: str, earlier: int = 0) -> InputError:
    """The refusal of a user the store at `path` (and `earlier` older stores of its model) has no list for:
    whose lists it holds."""
    manifest = read(path)
    among = (f"seen from part {manifest['first_part'] + 1} of the dataset on" if manifest["users_from"] == "window"
             else "of the dataset")
    return InputError(f"user {user!r}: no list in {path} (it holds the {manifest['users']:,} users {among}, "
                      f"ranked by version {manifest['version']}"
                      + (f"; nor do its lists of {earlier} earlier night(s)" if earlier else "")
                      + "); accepted: a raw user id of those users, as the dataset spells it")

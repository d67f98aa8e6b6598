"""Checkpoints and the exported model: stores many writers fill, proved complete by a manifest.

Checkpoint of a run after epoch N (run_dir/checkpoints/epoch-000N):

    shards/<device>/<table>/weights|state|version|ids   written by that device's shard (ids: the global
                      ids of its rows, so another plan can take them: shardflow.training.rehome)
    shards/0/dense/<name>, shards/0/dense_opt/<slot> device 0: the MLP and its optimizer
    manifest.json     written last by the engine (CheckpointManifest): epochs done, step,
                      seed, model, every array's checksum, what the epoch measured

A retired checkpoint (retire_checkpoint: the run keeps only its newest and best) is its
manifest renamed retired.json, the epoch's record, and no shards: it is never restored.

Export (a version's model/): tables/<name> float32 [rows, dim] in global id order and
state/<name> float32 [rows] (their row-wise Adagrad sums), chunk k of both written by one
task (a table's chunks are equal, at most EXPORT_CHUNK_ROWS rows: chunk_rows_for);
dense/<name> and dense_opt/<slot> (the dense optimiser, whose step count the manifest
holds as dense_steps); manifest.json (ExportManifest) last. Each writer touches only its own
arrays or chunks (zarr 3 has no atomic commit); a store without its manifest is never read.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import zarr

from shardflow.errors import InputError
from shardflow.records import parse_record, plain
from storage.checksum import ArrayHash, combine
from storage.manifest import MANIFEST, read_manifest, write_manifest
from storage.versions import CURRENT

CHECKPOINT, EXPORT = "checkpoint", "model"
FORMAT_VERSION = 1
MADE_BY = "a shardflow training run"
EXPORT_CHUNK_ROWS = 1 << 16
# zarr stores an array's last chunk whole, past the array's end too: a 4,000-row table of dim 2,048 in
# chunks of 2^16 rows took 537 MB on disk, not 33 MB. Chunks of equal size pad fewer rows than there are chunks.
# Trained float32 weights barely compress: blosc-zstd saved 7.6% of a 2·10^6 × 64 table at
# 516-711 MB/s against 1,309-1,650 MB/s written as they are (3 rounds, 2 cores), so
# checkpoints and exports are stored uncompressed.
COMPRESSORS = None
_EPOCH_DIR = re.compile(r"^epoch-(\d{6})$")
RETIRED = "retired.json"  # a retired checkpoint's manifest: its epoch's record, its shards deleted


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    """A checkpoint's manifest.json: where training stood after `epochs_done` epochs, the model
    (shardflow.data.clicks.config_record), every array's checksum (`arrays`, combined in `checksum`),
    and what the epoch measured: each figure None where the workload has none (sequences have no
    log-loss, click logs no HR@10) or the writer measured none."""

    epochs_done: int
    step: int
    dense_steps: int
    devices: int
    model: dict
    batch_size: int
    seed: int
    arrays: dict
    checksum: str
    loss: float | None = None
    auc: float | None = None
    hr_at_10: float | None = None
    ndcg_at_10: float | None = None
    logloss: float | None = None
    val_auc: float | None = None
    val_hr_at_10: float | None = None
    val_ndcg_at_10: float | None = None
    val_logloss: float | None = None
    val_full_hr_at_10: float | None = None  # the validation split ranked among the whole catalog (sequences)
    val_full_ndcg_at_10: float | None = None
    val_full_hr_at_20: float | None = None
    val_full_ndcg_at_20: float | None = None
    bytes_per_step: float | None = None
    examples_per_s: float | None = None
    seconds: float | None = None

    @property
    def figures(self) -> dict[str, float | None]:
        """What the epoch measured, by name (loss, the metrics, their val_ twins, bytes_per_step, speed)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _FIGURES}


_FIGURES = {f.name for f in fields(CheckpointManifest) if f.default is None}


@dataclass(frozen=True, kw_only=True)
class ExportManifest:
    """An exported model's manifest.json: each table's rows (chunked by `table_chunk_rows`; an export made before
    that field lists none, its tables chunked by `chunk_rows`), the model
    (shardflow.data.clicks.config_record) and its dense optimiser with the step count its state has
    reached, every chunk's checksum; the epochs trained, the one kept and the plan's strategy where
    the run said (None from an engine used without the flow)."""

    tables: dict
    dim: int
    model: dict
    chunk_rows: int
    dense_steps: int
    arrays: dict
    checksum: str
    dense_optimizer: str = "adam"  # what an export made before its manifest named one was trained with
    row_optimizer: str = "adagrad"  # likewise: the only row optimizer before there were two
    epochs: int | None = None
    best_epoch: int | None = None
    strategy: str | None = None
    table_chunk_rows: dict = field(default_factory=dict)

    def rows_per_chunk(self, table: str) -> int:
        """Rows per chunk of `table`'s arrays, or an InputError when the manifest holds no positive integer."""
        n = self.table_chunk_rows.get(table, self.chunk_rows)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"rows per chunk of table {table!r} = {n!r}; accepted: an integer >= 1 (the manifest "
                             "is damaged)")
        return n


def chunk_rows_for(rows: int) -> int:
    """Rows per chunk of an array of `rows` rows: as few chunks as EXPORT_CHUNK_ROWS allows, of equal size, so
    that the last, stored whole, pads fewer rows than there are chunks."""
    chunks = max(1, -(-rows // EXPORT_CHUNK_ROWS))
    return max(1, -(-rows // chunks))


def checkpoint_dir(run_dir: str | Path, epochs_done: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"epoch-{epochs_done:06d}"


READ_BLOCK_ROWS = 8 * EXPORT_CHUNK_ROWS  # rows read at a time into a restored shard


def digest(name: str, values: np.ndarray) -> str:
    h = ArrayHash(name, values.dtype, values.shape)
    h.update(values)
    return h.hexdigest()


def write_arrays(root: Path, arrays: dict[str, np.ndarray], prefix: str) -> dict[str, str]:
    """Write every array under `root` (a directory only this writer uses); {prefix/name: checksum}."""
    group = zarr.open_group(str(root), mode="w")
    digests = {}
    for name, values in arrays.items():
        values = np.ascontiguousarray(values)
        chunks = (chunk_rows_for(values.shape[0] if values.ndim else 1),) + values.shape[1:]
        arr = group.create_array(name, shape=values.shape, dtype=values.dtype, chunks=chunks, compressors=COMPRESSORS)
        arr[...] = values
        digests[f"{prefix}/{name}"] = digest(f"{prefix}/{name}", values)
    return digests


def _open(root: Path, name: str) -> zarr.Array:
    try:
        return zarr.open_array(str(Path(root) / name), mode="r")
    except Exception as e:  # zarr raises several types for missing or truncated data
        raise InputError(f"{root}/{name}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None


def _hashed(root: Path, name: str, prefix: str, digests: dict[str, str], arr: zarr.Array, sink=None) -> None:
    """Stream `arr` block by block through its checksum (and into `sink`, if given); an InputError if it
    does not match."""
    key = f"{prefix}/{name}"
    h = ArrayHash(key, arr.dtype, arr.shape)
    try:
        for a, b in _blocks(arr.shape):
            block = arr[a:b] if arr.shape else arr[...]
            h.update(block)
            if sink is not None:
                sink[a:b] = block
    except Exception as e:
        raise InputError(f"{root}/{name}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    if digests.get(key) != h.hexdigest():
        raise InputError(f"{root}/{name}: content does not match its checksum in the manifest; the store is damaged")


def verify_arrays(root: Path, names: list[str], prefix: str, digests: dict[str, str]) -> None:
    """Check arrays written by write_arrays against their checksums, a block at a time; a missing or
    altered one is named."""
    for name in names:
        _hashed(root, name, prefix, digests, _open(root, name))


def read_arrays(root: Path, names: list[str], prefix: str, digests: dict[str, str],
                into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Read and verify arrays written by write_arrays; a missing or altered one is named.

    An array named in `into` is read into that array (of the stored shape) block by block:
    a restore needs one block of memory, not a second copy of the shard. Call
    verify_arrays first where a damaged array must leave the targets untouched.
    """
    into = into or {}
    out = {}
    for name in names:
        arr = _open(root, name)
        target = into.get(name)
        if target is None:
            target = np.empty(arr.shape, dtype=arr.dtype)
        elif tuple(arr.shape) != tuple(target.shape):
            raise InputError(f"{root}/{name}: shape {tuple(arr.shape)}; accepted: {tuple(target.shape)} (the rows "
                             "this plan puts on the device, the model's dimension, the rows' optimizer state)")
        _hashed(root, name, prefix, digests, arr, target)
        out[name] = target
    return out


def _blocks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    rows = shape[0] if shape else 1
    step = READ_BLOCK_ROWS
    return [(a, min(a + step, rows)) for a in range(0, max(rows, 1), step)]


def sealed(digests: dict[str, str]) -> dict:
    """The `arrays` and `checksum` fields of a manifest over these array checksums."""
    return {"arrays": digests, "checksum": combine(digests)}


def finish(store: Path, manifest: CheckpointManifest | ExportManifest) -> None:
    """Write the manifest of a checkpoint or export into `store`, last: from then on it is complete."""
    kind = CHECKPOINT if isinstance(manifest, CheckpointManifest) else EXPORT
    write_manifest(store, {"format": f"shardflow.{kind}", "format_version": FORMAT_VERSION, **plain(manifest)})


def read(store: str | Path, kind: str, name: str = MANIFEST) -> dict:
    return read_manifest(Path(store), kind, FORMAT_VERSION, MADE_BY, name)


def read_checkpoint(store: str | Path) -> CheckpointManifest:
    """The manifest of a complete checkpoint, or an InputError naming what is missing or bad."""
    return parse_record(CheckpointManifest, read(store, CHECKPOINT), f"{store}/{MANIFEST}")


def retire_checkpoint(store: str | Path) -> None:
    """Delete a complete checkpoint's shards, keeping its manifest as the record of its epoch (RETIRED).

    The manifest is renamed first: from then on no reader takes the checkpoint for
    complete, and a deletion cut off part-way leaves shards that the next call removes.
    """
    store = Path(store)
    if (store / MANIFEST).is_file():
        os.replace(store / MANIFEST, store / RETIRED)
    if (store / RETIRED).is_file():
        shutil.rmtree(store / "shards", ignore_errors=True)


def sweep_retired(run_dir: str | Path) -> list[str]:
    """Delete the shards a cut-off retire_checkpoint left in `run_dir`'s retired checkpoints; their names."""
    root = Path(run_dir) / "checkpoints"
    left = [p for p in sorted(root.iterdir()) if _EPOCH_DIR.match(p.name) and (p / RETIRED).is_file()
            and (p / "shards").exists()] if root.is_dir() else []
    for p in left:
        retire_checkpoint(p)
    return [f"{p.name}/shards" for p in left]


def epoch_records(run_dir: str | Path) -> list[tuple[int, CheckpointManifest]]:
    """(epochs done, manifest) of every epoch whose checkpoint is complete or retired, oldest first: what each
    epoch measured. A retired record that does not read is left out, as an unreadable manifest is."""
    records = {e: m for e, _, m, _ in _with_manifests(run_dir, RETIRED) if m is not None}
    records.update((e, m) for e, _, m, _ in _with_manifests(run_dir) if m is not None)  # a complete one wins
    return sorted(records.items())


def read_export_manifest(store: str | Path) -> ExportManifest:
    """The manifest of a complete export (not its chunks: verify_export reads those too)."""
    return parse_record(ExportManifest, read(store, EXPORT), f"{store}/{MANIFEST}")


def verify_export(store: str | Path) -> ExportManifest:
    """Read every chunk of an exported model and check it against the manifest; the manifest.

    A store without its manifest (a download cut off) is refused as incomplete; a chunk
    changed or deleted since it was written is named.
    """
    store = Path(store)
    if not (store / MANIFEST).is_file():
        raise InputError(f"{store}: no {MANIFEST}; the export is incomplete (a download was cut off) or absent"
                         + _export_within(store))
    m = read_export_manifest(store)
    expected = dict(m.arrays)
    for table, rows in m.tables.items():
        for kind in ("tables", "state"):
            try:
                arr = zarr.open_array(str(store / kind / table), mode="r")
            except Exception as e:  # zarr raises several types for missing metadata
                raise InputError(
                    f"{store}/{kind}/{table}: unreadable ({type(e).__name__}); the export is damaged"
                ) from None
            try:
                step = m.rows_per_chunk(table)
            except InputError as e:
                raise InputError(f"{store}/{MANIFEST}: {e}") from None
            for start in range(0, rows, step):
                name = f"{kind}/{table}/{start}"
                try:
                    values = arr[start : start + step]
                except Exception as e:
                    raise InputError(
                        f"{store}/{name}: unreadable ({type(e).__name__}: {e}); the export is damaged"
                    ) from None
                if digest(name, values) != expected.pop(name, None):
                    raise InputError(
                        f"{store}/{name}: rows {start}.. do not match their checksum; the export is damaged"
                    )
    for group in ("dense", "dense_opt"):
        names = sorted(k.removeprefix(f"{group}/") for k in expected if k.startswith(f"{group}/"))
        read_arrays(store / group, names, group, m.arrays)
    return m


def _export_within(path: Path) -> str:
    """A refusal's hint when `path` is a model version's directory or a run_dir: the export in it."""
    for inner in (path / EXPORT, path / CURRENT / EXPORT):
        if (inner / MANIFEST).is_file():
            return f"; accepted: an export's directory, such as {inner}"
    return ""


def create_export(store: Path, tables: dict[str, int], dim: int, state: tuple[int, ...] = ()) -> None:
    """The empty arrays of an export: `tables/<t>` [rows, dim] and `state/<t>` [rows, *state] (a row's optimizer
    state: () for Adagrad's sum), chunked by chunk_rows_for."""
    root = zarr.open_group(str(store), mode="w")
    for name, rows in tables.items():
        step = chunk_rows_for(rows)
        root.create_array(f"tables/{name}", shape=(rows, dim), dtype=np.float32, chunks=(step, dim),
                          compressors=COMPRESSORS)
        root.create_array(f"state/{name}", shape=(rows, *state), dtype=np.float32, chunks=(step, *state),
                          compressors=COMPRESSORS)


def write_export_chunk(
    store: str | Path, table: str, start: int, rows: np.ndarray, state: np.ndarray
) -> dict[str, str]:
    """Rows start.. of `table` and their optimizer state, one chunk only this writer writes; {chunk name: digest}."""
    out = {}
    for kind, values in (("tables", rows), ("state", state)):
        zarr.open_array(f"{store}/{kind}/{table}", mode="r+")[start : start + values.shape[0]] = values
        out[f"{kind}/{table}/{start}"] = digest(f"{kind}/{table}/{start}", values)
    return out


def read_export(store: str | Path, kind: str, table: str, ids: np.ndarray, zeros_past_end: bool = False
                ) -> np.ndarray:
    """Entries `ids` of an export's `kind` array of `table` (`tables`: rows, `state`: their optimizer state), each
    chunk read once whatever the ids' order.

    With `zeros_past_end`, ids past the exported table's end (added to the dataset since)
    get zeros; otherwise they are refused.
    """
    arr = zarr.open_array(str(Path(store) / kind / table), mode="r")
    ids = np.asarray(ids, dtype=np.int64)
    known = ids < arr.shape[0]
    if not zeros_past_end and not known.all():
        raise InputError(f"{store}/{kind}/{table}: id {int(ids[~known][0])} past its {arr.shape[0]:,} rows")
    out = np.zeros((ids.size,) + arr.shape[1:], dtype=np.float32)
    where = np.flatnonzero(known)
    if where.size:
        order = where[np.argsort(ids[where], kind="stable")]  # ascending ids: each chunk read once
        out[order] = arr.get_orthogonal_selection((ids[order],) + (slice(None),) * (arr.ndim - 1))
    return out


def read_export_dense(store: str | Path, shapes: dict[str, tuple], optimizer_state: list[str]
                      ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(dense layers, their optimiser state) of an export; a layer whose shape is not `shapes[name]` is refused."""
    dense = {}
    for k, shape in shapes.items():
        v = zarr.open_array(str(Path(store) / "dense" / k), mode="r")[...]
        if v.shape != tuple(shape):
            raise InputError(f"{store}/dense/{k}: shape {v.shape}; accepted: {tuple(shape)}")
        dense[k] = v
    state = {k: zarr.open_array(str(Path(store) / "dense_opt" / k), mode="r")[...] for k in optimizer_state}
    return dense, state


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(epochs done, path) of every checkpoint whose manifest reads, oldest first. A manifest cut short or
    garbled (a disk that filled, a write cut off) makes its checkpoint incomplete, as a missing one does:
    every reader falls back to the ones before (unreadable_checkpoints names it)."""
    return [(epochs, path) for epochs, path, manifest, _ in _with_manifests(run_dir) if manifest is not None]


def unreadable_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, str]]:
    """(epochs done, path, why) of every checkpoint whose manifest is there but does not read."""
    return [(epochs, path, why) for epochs, path, _, why in _with_manifests(run_dir) if why is not None]


def _with_manifests(run_dir: str | Path, name: str = MANIFEST
                    ) -> list[tuple[int, Path, CheckpointManifest | None, str | None]]:
    """(epochs done, path, its manifest or None, why it does not read or None) of every epoch directory of
    `run_dir` that has the file `name` (a complete checkpoint's MANIFEST, a retired one's RETIRED), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _EPOCH_DIR.match(p.name)
        if m and (p / name).is_file():
            try:
                found.append((int(m.group(1)), p, parse_record(CheckpointManifest, read(p, CHECKPOINT, name),
                                                               f"{p}/{name}"), None))
            except InputError as e:
                found.append((int(m.group(1)), p, None, str(e)))
    return sorted(found, key=lambda f: f[0])

"""Distributed frequency profiling: per-row access counts, in parallel over a dataset's chunks.

Every table's events are cut into one chunk-aligned block per worker; a task counts its
block chunk group by chunk group (bounded memory), one task per table sums the blocks'
counts and writes them, and the manifest is published last. The counts never travel
through the client.

A model version trains on a window of the log (its newest parts); its plan and cost model
are fitted to what that window's examples read (`profile_window`): every row's lookups by
the window's training examples, each one's history (up to `history` earlier items of
its user, from before the window too) and its positive; a feature table once per example.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from logging import Logger, LoggerAdapter
from pathlib import Path

import numpy as np
from distributed import Client, wait

from shardflow.cluster import worker_count
from shardflow.data.batches import ORDER_BLOCK_EVENTS
from shardflow.data.windows import window_targets
from shardflow.errors import DamagedStore, InputError
from shardflow.profiling.counting import count_ids, table_stats
from storage.dataset import Dataset, open_column
from storage.lock import writer_lock
from storage.manifest import MANIFEST
from storage.profile import (
    Profile,
    ProfiledDataset,
    ProfileManifest,
    TableStats,
    Window,
    finish_profile,
    start_profile,
    write_counts,
)
from storage.staging import check_destination, for_workers, staged


def count_block(dataset: str, array: str, rows: int, start: int, stop: int) -> np.ndarray:
    """Counts of every row of a table over events [start, stop) of one stored `array`, a chunk at a time.

    The next chunk is read and decoded in a helper thread while this one is counted
    (decompression releases the GIL), so reading hides behind counting.
    """
    column = open_column(dataset, array)
    step = column.chunks[0]
    starts = range(start, stop, step)
    counts = np.zeros(rows, dtype=np.int64)
    with ThreadPoolExecutor(max_workers=1) as reader:
        ahead = reader.submit(column.__getitem__, slice(start, min(stop, start + step)))
        for a in starts:
            ids = np.asarray(ahead.result())
            if a + step < stop:
                ahead = reader.submit(column.__getitem__, slice(a + step, min(stop, a + 2 * step)))
            if ids.ndim == 2:  # a table of token sequences: every id an event holds, not the padding (-1)
                ids = ids[ids != -1]
            count_ids(ids, rows, where=f"{dataset}/{array}", first_position=a, out=counts)
    return counts


def sum_and_write(stage: str, table: str, *blocks: np.ndarray) -> tuple[TableStats, str]:
    """Sum a table's block counts; write them while their statistics are computed."""
    counts = blocks[0] if len(blocks) == 1 else np.sum(blocks, axis=0)
    with ThreadPoolExecutor(max_workers=1) as writer:
        digest = writer.submit(write_counts, stage, table, counts)
        stats = table_stats(counts)
        return stats, digest.result()


def check_inputs(dataset: str | Path, out: str | Path, *, overwrite: bool) -> Dataset:
    """Everything that can be refused before a cluster starts: the dataset, the destination."""
    ds = Dataset.open(dataset)
    check_destination(Path(out), overwrite=overwrite, reads=(dataset,))
    return ds


def profile_dataset(
    dataset: str | Path, out: str | Path, *, client: Client, overwrite: bool = False, blocks: int | None = None,
    first: int = 0, window: Window | None = None,
) -> ProfileManifest:
    """Profile `dataset` (its events of parts `first` on) into a profile store at `out`; the manifest.
    `window`: what the manifest records of the window (default: its first part)."""
    ds = check_inputs(dataset, out, overwrite=overwrite)
    blocks = blocks or worker_count(client)
    with writer_lock(out), staged(Path(out), overwrite=overwrite) as stage:
        start_profile(stage)
        per_table, pending = {}, []
        for t in ds.info.tables:
            parts = [
                client.submit(count_block, for_workers(ds.path), array, t.rows, a, b, pure=False)
                for array, a, b in ds.blocks(t.name, blocks, first)
            ]
            per_table[t.name] = client.submit(sum_and_write, for_workers(stage), t.name, *parts, pure=False)
            pending += parts + [per_table[t.name]]
        # Let every task finish before the staging directory can be removed on an error.
        wait(pending)
        results = client.gather(per_table)
        return finish_profile(
            stage,
            ProfiledDataset(str(ds.path.resolve()), ds.info.checksum, window or Window(first)),
            {name: stats for name, (stats, _) in results.items()},
            {name: digest for name, (_, digest) in results.items()},
        )


def window_lookups(dataset: str, table: str, first: int, history: int, start: int, stop: int,
                   held: int = 1) -> tuple[np.ndarray, int]:
    """(lookups of every row of `table`, training examples) by the window-from-part-`first` examples whose
    targets lie in events start:stop (user order), a block of ORDER_BLOCK_EVENTS at a time; each user's last
    `held` events are not trained on (2 with a validation split)."""
    ds = Dataset.open(dataset)
    offsets = ds.offsets()
    item, rows = ds.info.sequence_table, ds.info.table(table).rows
    counts, examples = np.zeros(rows, dtype=np.int64), 0
    for a in range(start, stop, ORDER_BLOCK_EVENTS):
        b = min(a + ORDER_BLOCK_EVENTS, stop)
        targets = window_targets(ds, offsets, a, b, first, held=held)
        examples += targets.size
        if not targets.size:
            continue
        if table != item:  # a feature table is read at the example's own event
            counts += np.bincount(ds.column(f"tables/{table}", a, b)[targets - a], minlength=rows)
            continue
        user = np.searchsorted(offsets, targets, side="right") - 1
        reach = np.maximum(targets - history, offsets[user])  # a target's history: events reach .. target - 1
        lo = int(reach.min())
        reads = np.cumsum(np.bincount(reach - lo, minlength=b - lo + 1)
                          - np.bincount(targets - lo, minlength=b - lo + 1))[: b - lo]
        reads[targets - lo] += 1  # the positive
        counts += np.bincount(ds.column(f"tables/{table}", lo, b), weights=reads, minlength=rows).astype(np.int64)
    return counts, examples


def sum_lookups(stage: str, table: str, *blocks: tuple[np.ndarray, int]) -> tuple[TableStats, str, int, int]:
    """A table's window lookups summed and written: (stats, digest, lookups, examples)."""
    stats, digest = sum_and_write(stage, table, *(counts for counts, _ in blocks))
    return stats, digest, stats.accesses, sum(n for _, n in blocks)


def profile_window(dataset: str | Path, out: str | Path, *, client: Client, first: int, history: int,
                   overwrite: bool = False, blocks: int | None = None, held: int = 1) -> ProfileManifest:
    """Profile what the training examples of the window from part `first` read (module docstring), each
    user's last `held` events left out as training leaves them (2 with a validation split).

    A click log's examples read each table once per row: its window is the rows of parts
    `first` on. The manifest's dataset record says the window and, for the item sequence,
    its lookups per example (history and positive; negatives are uniform and not counted).
    """
    ds = check_inputs(dataset, out, overwrite=overwrite)
    if ds.info.sequence_table is None:
        return profile_dataset(dataset, out, client=client, overwrite=overwrite, blocks=blocks, first=first,
                               window=Window(first, history, held=held))
    if history < 1:
        raise InputError(f"history = {history}; accepted: history >= 1")
    events = int(ds.offsets()[-1])
    n = blocks or worker_count(client)
    step = -(-max(events, 1) // (n * ORDER_BLOCK_EVENTS)) * ORDER_BLOCK_EVENTS
    ranges = [(a, min(a + step, events)) for a in range(0, events, step)]
    with writer_lock(out), staged(Path(out), overwrite=overwrite) as stage:
        start_profile(stage)
        per_table, pending = {}, []
        for t in ds.info.tables:
            parts = [client.submit(window_lookups, for_workers(ds.path), t.name, first, history, a, b, held, pure=False)
                     for a, b in ranges]
            per_table[t.name] = client.submit(sum_lookups, for_workers(stage), t.name, *parts, pure=False)
            pending += parts + [per_table[t.name]]
        wait(pending)
        results = client.gather(per_table)
        item = results[ds.info.sequence_table]
        window = Window(first, history, examples=item[3], item_lookups=item[2], held=held)
        return finish_profile(
            stage,
            ProfiledDataset(str(ds.path.resolve()), ds.info.checksum, window),
            {name: r[0] for name, r in results.items()},
            {name: r[1] for name, r in results.items()},
        )


def profile_version(dataset: str, out: str | Path, *, client: Client, first: int, history: int | None,
                    log: Logger | LoggerAdapter[Logger], held: int = 1) -> dict[str, TableStats]:
    """Every table's figures of a model version's profile at `out`: per-row lookups by the training window's
    examples (parts `first` on, with their `history`-item histories), or, without `history`, per-row accesses
    of the whole log. A complete profile of this very dataset and window is read back (a damaged one is
    logged and made again: it is derived from the dataset, not a failure every night)."""
    there = (Path(out) / MANIFEST).is_file()
    kept = None
    if there:
        try:
            kept = Profile.open(out)
        except DamagedStore as e:
            log.warning("%s; profiling again", e)
    made = kept.dataset if kept else None
    if kept is not None and made and (made.checksum, made.window.first_part, made.window.history,
                                      made.window.held) == (Dataset.open(dataset).info.checksum, first, history,
                                                            held if history is not None else 1):
        log.info("reusing profile %s", out)
        return kept.stats
    if history is None:
        return profile_dataset(dataset, out, client=client, overwrite=there, first=first).tables
    return profile_window(dataset, out, client=client, first=first, history=history, overwrite=there,
                          held=held).tables


SPARSE_HASHED_SHARE = 0.1  # hashed tables whose version's examples read less than this share of rows are warned of


def unread_hashed_rows(dataset: str, stats: dict[str, TableStats]) -> str | None:
    """A warning when a click log's hashed tables (criteo's hash_rows, recorded by its import) are mostly rows
    that no example of the version reads (its profile's `stats`): each checkpoint and the export store them all."""
    source = Dataset.open(dataset).info.source
    options = source.get("options") if isinstance(source, dict) else None
    hash_rows = options.get("hash_rows") if isinstance(options, dict) else None
    if not isinstance(hash_rows, int) or isinstance(hash_rows, bool):
        return None
    rows = sum(s.rows for s in stats.values())
    read = sum(s.distinct for s in stats.values())
    if not rows or read >= SPARSE_HASHED_SHARE * rows:
        return None
    return (f"this version's examples read {read:,} of the {rows:,} rows of its {len(stats)} hashed tables "
            f"({read / rows:.1%}; hash_rows {hash_rows:,}): every checkpoint and the export store them all; a run_dir "
            "imported with a smaller hash_rows, or exact (a row per value), stores what the log reads")

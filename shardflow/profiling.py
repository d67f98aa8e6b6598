"""Distributed frequency profiling: per-row access counts, in parallel over a dataset's chunks.

Every table's events are cut into one chunk-aligned block per worker; a task counts its
block chunk group by chunk group (bounded memory), one task per table sums the blocks'
counts and writes them, and the manifest is published last. The counts never travel
through the client.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from distributed import Client, wait

from shardflow.cluster import worker_count
from shardflow.counting import count_ids, table_stats
from storage.dataset import Dataset, open_column
from storage.profile import finish_profile, start_profile, write_counts
from storage.lock import writer_lock
from storage.staging import check_destination, staged

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
            ids = ahead.result()
            if a + step < stop:
                ahead = reader.submit(column.__getitem__, slice(a + step, min(stop, a + 2 * step)))
            count_ids(ids, rows, where=f"{dataset}/{array}", first_position=a, out=counts)
    return counts


def sum_and_write(stage: str, table: str, *blocks: np.ndarray) -> tuple[dict, str]:
    """Sum a table's block counts; write them while their statistics are computed."""
    counts = blocks[0] if len(blocks) == 1 else np.sum(blocks, axis=0)
    with ThreadPoolExecutor(max_workers=1) as writer:
        digest = writer.submit(write_counts, stage, table, counts)
        stats = table_stats(counts).to_dict()
        return stats, digest.result()


def check_inputs(dataset: str | Path, out: str | Path, *, overwrite: bool) -> Dataset:
    """Everything that can be refused before a cluster starts: the dataset, the destination."""
    ds = Dataset.open(dataset)
    check_destination(Path(out), overwrite=overwrite)
    return ds


def profile_dataset(
    dataset: str | Path, out: str | Path, *, client: Client, overwrite: bool = False, blocks: int | None = None
) -> dict:
    """Profile `dataset` into a profile store at `out`; returns the profile's manifest."""
    ds = check_inputs(dataset, out, overwrite=overwrite)
    blocks = blocks or worker_count(client)
    with writer_lock(out), staged(Path(out), overwrite=overwrite) as stage:
        start_profile(stage)
        per_table, pending = {}, []
        for t in ds.info.tables:
            parts = [
                client.submit(count_block, str(ds.path), array, t.rows, a, b, pure=False)
                for array, a, b in ds.blocks(t.name, blocks)
            ]
            per_table[t.name] = client.submit(sum_and_write, str(stage), t.name, *parts, pure=False)
            pending += parts + [per_table[t.name]]
        # Let every task finish before the staging directory can be removed on an error.
        wait(pending)
        results = client.gather(per_table)
        return finish_profile(
            stage,
            {"path": str(ds.path.resolve()), "checksum": ds.info.checksum},
            {name: stats for name, (stats, _) in results.items()},
            {name: digest for name, (_, digest) in results.items()},
        )

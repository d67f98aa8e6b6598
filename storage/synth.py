"""Write a synthetic dataset store, one block of events at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardflow.errors import InputError
from shardflow.synthetic import SynthTable, synth_blocks, user_lengths
from storage.dataset import EVENTS_PER_CHUNK, SegmentWriter, build_manifest, record_verified, segment_name, start_store
from storage.lock import writer_lock
from storage.manifest import write_manifest
from storage.staging import check_destination, staged


def synth_dataset(
    dest: str | Path,
    tables: list[SynthTable],
    *,
    interactions: int,
    seed: int,
    mean_length: float = 20.0,
    overwrite: bool = False,
    events_per_chunk: int = EVENTS_PER_CHUNK,
) -> dict:
    """Generate and store a dataset; the first table is the item sequence, the others feature columns.

    At most one block of `events_per_chunk` ids per table is in memory at a time.
    """
    if not tables:
        raise InputError("no tables given; accepted: at least one NAME:ROWS[:ALPHA]")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise InputError(f"table names repeat: {names}; accepted: unique names")
    if isinstance(interactions, bool) or not isinstance(interactions, int) or interactions < 1:
        raise InputError(f"interactions = {interactions!r}; accepted: an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"seed = {seed!r}; accepted: an integer >= 0")
    if events_per_chunk < 1:
        raise InputError(f"events per chunk = {events_per_chunk}; accepted: an integer >= 1")
    dest = Path(dest)
    check_destination(dest, overwrite=overwrite)
    lengths = user_lengths(interactions, mean_length, seed)
    users = len(lengths)
    with writer_lock(dest), staged(dest, overwrite=overwrite) as stage:
        writer = SegmentWriter(
            start_store(stage) / segment_name(0),
            events=interactions,
            runs=users,
            tables={t.name: t.spec.id_dtype for t in tables},
            events_per_chunk=events_per_chunk,
        )
        writer.write_runs(np.arange(users), np.concatenate([[0], np.cumsum(lengths)]))
        writer.write_user_ids(np.arange(users))
        for name, block in synth_blocks(tables, interactions, seed, events_per_chunk):
            writer.write(f"tables/{name}", block)
        for t in tables:
            identity = np.arange(t.rows)
            writer.write_raw_ids(t.name, identity, identity)
        manifest = build_manifest(
            version=1,
            users=users,
            tables={t.name: {"rows": t.rows, "dtype": str(t.spec.id_dtype)} for t in tables},
            sequence_table=tables[0].name,
            dense=(),
            labels=False,
            source={
                "generator": "shardflow synth",
                "tables": [f"{t.name}:{t.rows}:{t.alpha}" for t in tables],
                "interactions": interactions,
                "mean_length": mean_length,
                "seed": seed,
            },
            segments=[writer.finish(segment_name(0), 1)],
        )
        write_manifest(stage, manifest)
        record_verified(stage)
        return manifest

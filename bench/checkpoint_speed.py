"""Checkpoint and parameter-download speed against plain zarr writes of the same bytes, in the same run.

    python bench/checkpoint_speed.py [--rows 4000000] [--dim 64] [--devices 2] [--rounds 3]

A synthetic table of --rows rows on --devices workers (row-wise: id % devices), two
training steps so the shards hold trained rows, then per round, alternating:
  - checkpoint: Engine.checkpoint (every shard writes its rows, Adagrad sums and
    versions, plus device 0's MLP; checksums; the manifest; the staged rename);
  - plain:      every worker writes the same arrays of its shard with zarr, uncompressed,
                in the same chunks, nothing else;
  - export:     Engine.export (one task per chunk of at most 65,536 rows pulls rows and sums from
                their homes and writes them in global id order);
  - plain:      the same bytes ([rows, dim] and [rows] float32) written by one writer per
                worker into disjoint chunks of one zarr array, uncompressed.
Prints MB/s of each and min/median/max of checkpoint ÷ plain and export ÷ plain, and what
zstd (zarr's default compressor) would save on the trained weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from shardflow.cluster import dask_client
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.model.configs import ModelConfig, OptimizerConfig
from shardflow.planner.sharding_plan import SINGLE, ShardingPlan, TablePlan
from shardflow.planner.topology import uniform
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine
from storage.checkpoint import EXPORT_CHUNK_ROWS, chunk_rows_for

MB = 1e6


def _shard_arrays(dask_worker) -> dict:
    device = next(a.device for a in dask_worker.state.actors.values() if hasattr(a, "device"))
    sh = device.shard
    out = {}
    for t in sh.layouts:
        out[f"{t}/weights"] = sh.weights[t].numpy()
        out[f"{t}/state"] = sh.state[t].numpy()
        out[f"{t}/version"] = sh.version[t]
    if sh.dense is not None:
        out.update({f"dense/{k}": v.numpy() for k, v in sh.dense.items()})
    return out


def plain_checkpoint(root: str, dask_worker=None) -> int:
    """This worker's shard arrays, written as they are (the checkpoint's chunking, no checksums)."""
    arrays = _shard_arrays(dask_worker)
    group = zarr.open_group(os.path.join(root, dask_worker.address.replace("/", "_").replace(":", "_")), mode="w")
    for name, values in arrays.items():
        chunks = (chunk_rows_for(values.shape[0] if values.ndim else 1),) + values.shape[1:]
        group.create_array(name, shape=values.shape, dtype=values.dtype, chunks=chunks, compressors=None)[...] = values
    return sum(v.nbytes for v in arrays.values())


def plain_export(store: str, rows: int, workers: list[str], dask_worker=None) -> int:
    """This worker's share (chunks w, w + writers, ...) of [rows, dim] and [rows] float32 arrays, from its rows."""
    writer, writers = workers.index(dask_worker.address), len(workers)
    weights = _shard_arrays(dask_worker)["item/weights"]
    table = zarr.open_array(f"{store}/tables/item", mode="r+")
    state = zarr.open_array(f"{store}/state/item", mode="r+")
    written, step = 0, chunk_rows_for(rows)
    for k, start in enumerate(range(writer * step, rows, writers * step)):
        n = min(step, rows - start)
        block = weights[(k * step) % max(weights.shape[0] - n, 1):][:n]
        table[start : start + n] = block
        state[start : start + n] = block[:, 0]
        written += block.nbytes + n * 4
    return written


def spread(v: list[float]) -> str:
    return f"{min(v):.2f} / {float(np.median(v)):.2f} / {max(v):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    R, D, P = args.rows, args.dim, args.devices
    scratch = Path(tempfile.mkdtemp(prefix="shardflow-ckpt-", dir=os.environ.get("TMPDIR")))
    try:
        synth_dataset(scratch / "ds", [SynthTable("item", R, 1.0)], interactions=200_000, seed=1, mean_length=20)
        plan = ShardingPlan("row-wise-mod", (TablePlan("item", np.full(R, SINGLE, np.int8),
                                                       (np.arange(R) % P).astype(np.int32)),))
        model = ModelConfig(dim=D, mlp=(32,), history=20, negatives=4)
        print(f"{R:,} rows × dim {D} on {P} workers ({R * (D + 1) * 4 / MB:,.0f} MB of rows and sums), "
              f"{args.rounds} rounds, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, scratch {scratch}")
        rates: dict[str, list[float]] = {k: [] for k in ("checkpoint", "plain checkpoint", "export", "plain export")}
        with dask_client(workers=P) as client:
            with Engine(client, str(scratch / "ds"), plan, uniform(1, P, 10.0), model, OptimizerConfig(),
                        TrainConfig(batch_size=1024)) as engine:
                engine.steps(0, 0, 2)
                for r in range(args.rounds):
                    t = time.perf_counter()
                    engine.checkpoint(scratch / f"ckpt-{r}", r + 1)
                    took = time.perf_counter() - t
                    size = sum(f.stat().st_size for f in (scratch / f"ckpt-{r}").rglob("*") if f.is_file())
                    rates["checkpoint"].append(size / took / MB)
                    t = time.perf_counter()
                    wrote = sum(client.run(plain_checkpoint, str(scratch / f"plain-{r}")).values())
                    rates["plain checkpoint"].append(wrote / (time.perf_counter() - t) / MB)
                    t = time.perf_counter()
                    engine.export(scratch / f"model-{r}")
                    took = time.perf_counter() - t
                    rates["export"].append(R * (D + 1) * 4 / took / MB)
                    store = scratch / f"plain-model-{r}"
                    root = zarr.open_group(str(store), mode="w")
                    root.create_array("tables/item", shape=(R, D), dtype=np.float32,
                                      chunks=(chunk_rows_for(R), D), compressors=None)
                    root.create_array("state/item", shape=(R,), dtype=np.float32, chunks=(chunk_rows_for(R),),
                                      compressors=None)
                    workers = sorted(client.scheduler_info()["workers"])
                    t = time.perf_counter()
                    wrote = sum(client.run(plain_export, str(store), R, workers).values())
                    rates["plain export"].append(wrote / (time.perf_counter() - t) / MB)
                    for p in (f"ckpt-{r}", f"plain-{r}", f"model-{r}", f"plain-model-{r}"):
                        shutil.rmtree(scratch / p, ignore_errors=True)
                    print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:,.0f} MB/s" for k, v in rates.items()),
                          flush=True)
                weights = client.run(lambda dask_worker: _shard_arrays(dask_worker)["item/weights"][:500_000])
        sample = next(iter(weights.values()))
        packed = zarr.create_array(str(scratch / "zstd"), shape=sample.shape, dtype=sample.dtype,
                                   chunks=(EXPORT_CHUNK_ROWS, D))  # zarr's default compressor: zstd
        packed[...] = sample
        stored = sum(f.stat().st_size for f in (scratch / "zstd").rglob("*") if f.is_file() and f.name != "zarr.json")
        print(f"\n{'written as':<18} {'MB/s: min':>10} {'median':>8} {'max':>8}")
        for k, v in rates.items():
            print(f"{k:<18} {min(v):>10,.0f} {float(np.median(v)):>8,.0f} {max(v):>8,.0f}")
        ck = [a / b for a, b in zip(rates["checkpoint"], rates["plain checkpoint"], strict=True)]
        ex = [a / b for a, b in zip(rates["export"], rates["plain export"], strict=True)]
        print(f"checkpoint ÷ plain (min / median / max): {spread(ck)}")
        print(f"export ÷ plain (min / median / max):     {spread(ex)}")
        print(f"zstd on {sample.shape[0]:,} trained rows: {stored / sample.nbytes:.3f} of their bytes "
              f"(saves {1 - stored / sample.nbytes:.1%})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Profiling throughput: `shardflow profile` against np.bincount over the same ids in memory.

    python bench/profile_throughput.py [--ids 1e8] [--rows 1e7] [--alpha 1.2] [--workers 1 2]

Generates a seeded synthetic dataset (one Zipf table) in a scratch directory, then
measures in the same run:
  - the baseline: np.bincount(ids, minlength=rows) with every id already in memory;
  - profile_dataset on a LocalCluster of N single-threaded workers (cluster already
    started; its start-up is reported apart), reading the ids from the zarr store.
Prints ids per second and the ratio to the baseline. Each figure is the best of --repeat.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from shardflow.cluster import dask_client
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.profiling.profiles import profile_dataset
from storage.dataset import Dataset
from storage.profile import Profile


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ids", type=float, default=1e8)
    p.add_argument("--rows", type=float, default=1e7)
    p.add_argument("--alpha", type=float, default=1.2)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", help="scratch directory (default: a temporary one, removed afterwards)")
    args = p.parse_args()
    ids, rows = int(args.ids), int(args.rows)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardflow-bench-"))
    try:
        t = time.perf_counter()
        synth_dataset(work / "ds", [SynthTable("item", rows, args.alpha)], interactions=ids, seed=1, overwrite=True)
        print(f"synthetic dataset: {ids:,} ids over {rows:,} rows, Zipf({args.alpha}), "
              f"written in {time.perf_counter() - t:.1f} s")

        in_memory = Dataset.open(work / "ds").ids("item")
        reference = np.bincount(in_memory, minlength=rows)
        baseline_s = best_of(args.repeat, lambda: np.bincount(in_memory, minlength=rows))

        results = [("np.bincount, ids in memory", "-", baseline_s)]
        for n in args.workers:
            t = time.perf_counter()
            with dask_client(workers=n) as client:
                start_s = time.perf_counter() - t
                out = work / f"profile-{n}"
                elapsed = best_of(
                    args.repeat, lambda out=out: profile_dataset(work / "ds", out, client=client, overwrite=True)
                )
            assert np.array_equal(Profile.open(out).counts("item"), reference), "profile differs from bincount"
            results.append((f"shardflow profile, {n} worker{'s' * (n > 1)}", f"{start_s:.1f}", elapsed))

        print()
        print(f"| {'method':<30} | {'cluster start s':>15} | {'seconds':>8} | {'M ids/s':>8} | {'× bincount':>10} |")
        print(f"|{'-' * 32}|{'-' * 17}|{'-' * 10}|{'-' * 10}|{'-' * 12}|")
        for name, start, seconds in results:
            print(f"| {name:<30} | {start:>15} | {seconds:>8.2f} | {ids / seconds / 1e6:>8.1f} | "
                  f"{baseline_s / seconds:>10.2f} |")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

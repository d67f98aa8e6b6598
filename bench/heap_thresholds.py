"""The engine on workers Dask's own nanny started, with and without shardflow.heap's thresholds.

    python bench/heap_thresholds.py [--rounds 3] [--steps 20] [--devices 1]

A user's cluster (a scheduler_address, a cluster class other than a local one) starts
its workers with distributed's pre-spawn environment, MALLOC_TRIM_THRESHOLD_=65536,
which pins glibc's mmap threshold at 128 KiB (shardflow/heap.py). This measures, round
after round in alternation, bench/train_throughput.py's model and batches (the bundled
amazon-video log, batch 4,096, mean encoder, FlexShard plan) trained by:
  - pinned:   the engine on a distributed.LocalCluster of --devices single-threaded
              worker processes, as Dask starts them, through a plain client;
  - unpinned: the same on a second such cluster, on whose workers
              shardflow.cluster.heap_thresholds has registered HeapThresholds (what a run
              on a cluster it did not start does; a cluster of its own, as switching the
              plugin on and off leaves the heap of the last round behind);
  - local:    the engine on shardflow's own local cluster (no variable in its workers);
  - pytorch:  the reference trainer in this process, --devices threads (the limit).
It prints the load before every round, min/median/max examples/s and the ratios within
each round.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from distributed import Client, LocalCluster
from train_throughput import DATA, MODEL, engine_rate, plan_for, pytorch_rate, spread  # bench/ is on sys.path

from shardflow.cluster import LOOPBACK_DASHBOARD, dask_client, heap_thresholds
from shardflow.data.batches import TrainData
from storage.importers import import_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, choices=(1, 2), default=1)
    args = parser.parse_args()
    B, n, d = 4096, args.steps, args.devices
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        dataset = Path(scratch) / "amazon-video"
        import_dataset("sasrec", DATA, dataset)
        data = TrainData.load(dataset)
        plan = plan_for(dataset, d, B)
        rates: dict[str, list[float]] = {}
        loads = []
        dasks = [LocalCluster(n_workers=d, threads_per_worker=1, processes=True, dashboard_address=LOOPBACK_DASHBOARD)
                 for _ in range(2)]
        with dasks[0], dasks[1], Client(dasks[0]) as pinned_client, Client(dasks[1]) as unpinned_client, \
                heap_thresholds(unpinned_client), dask_client(workers=d) as local:
            env = set(pinned_client.run(os.getenv, "MALLOC_TRIM_THRESHOLD_").values())
            print(f"amazon-video, batch {B}, {n} steps, {d} device(s), {args.rounds} rounds, "
                  f"{os.cpu_count()} cores; Dask's workers: MALLOC_TRIM_THRESHOLD_={', '.join(map(str, env))}")
            clients = {"engine, pinned": pinned_client, "engine, unpinned": unpinned_client,
                       "engine, local cluster": local}
            for r in range(args.rounds):
                loads.append(os.getloadavg()[0])
                print(f"round {r + 1}: load {loads[-1]:.2f}", flush=True)
                for name, client in clients.items():
                    rates.setdefault(name, []).append(engine_rate(client, dataset, *plan, B, n)["rate"])
                rates.setdefault("pytorch", []).append(pytorch_rate(data, MODEL, B, n, d))
    print(f"\nload {min(loads):.2f}-{max(loads):.2f} at the rounds' starts")
    print(f"{'trainer':<24} {'examples/s: min':>15} {'median':>9} {'max':>9}")
    for name, v in rates.items():
        print(f"{name:<24} {min(v):>15,.0f} {float(np.median(v)):>9,.0f} {max(v):>9,.0f}")
    pinned, unpinned = rates["engine, pinned"], rates["engine, unpinned"]
    ratios = {
        "unpinned / pinned": [a / b for a, b in zip(unpinned, pinned, strict=True)],
        "unpinned / local cluster": [a / b for a, b in zip(unpinned, rates["engine, local cluster"], strict=True)],
        "pinned / pytorch": [a / b for a, b in zip(pinned, rates["pytorch"], strict=True)],
        "unpinned / pytorch": [a / b for a, b in zip(unpinned, rates["pytorch"], strict=True)],
    }
    print(f"\n{'ratio (per round)':<28} {'min':>9} {'median':>7} {'max':>7}")
    for name, v in ratios.items():
        print(f"{name:<28} {spread(v)}")


if __name__ == "__main__":
    main()

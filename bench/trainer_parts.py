"""What a trainer holds of the log, and what reading its examples costs, as its part shrinks.

    python bench/trainer_parts.py [--events 20000000] [--rounds 3] [--every 3]

A synthetic log (a Zipf(1.1) item table of 10^6 rows, sessions of 20 events on average)
is read as the engine's trainers read it: every `--every`-th global batch of an epoch
(batch 4,096, blocks of 2^20 events), split over 1, 2 and 4 trainers, each trainer with
its own reader holding only its part of each block (`read_in_parts`). Printed per
trainer count: the most any trainer's cache of parts held, the seconds one trainer spent
building its sub-batches' examples over the epoch (min / median / max over rounds, the
counts alternating within each round), their ratio to one trainer reading whole blocks
in the same round, and how much larger than batch / trainers the largest sub-batch of a
step is (the step waits for it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from shardflow.data.batches import TrainData, negative_seed
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.model.configs import ModelConfig

TRAINERS = (1, 2, 4)
BATCH = 4096


def read_epoch(path: Path, trainers: int, every: int) -> tuple[int, float, np.ndarray]:
    """(the most a trainer held in bytes, the slowest trainer's seconds building examples, the largest
    sub-batch of each step over batch / trainers)."""
    model = ModelConfig()
    readers = [TrainData.load(path) for _ in range(trainers)]
    for r in readers:
        r.read_in_parts(trainers)
    held, seconds, largest = 0, np.zeros(trainers), []
    for step in range(0, readers[0].steps_per_epoch(BATCH), every):
        subs = readers[0].sub_batches(readers[0].batch(0, 0, step, BATCH), trainers)
        largest.append(max(s.size for s in subs) / (BATCH / trainers))
        for d, reader in enumerate(readers):
            t0 = time.perf_counter()
            reader.examples(subs[d], model, negative_seed(0, 0))
            seconds[d] += time.perf_counter() - t0
            held = max(held, sum(v.nbytes for part in reader._cache.values() for v in part.columns.values()))
    return held, float(seconds.max()), np.array(largest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=3, help="read every n-th batch of the epoch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardflow-parts-") as scratch:
        path = Path(scratch) / "ds"
        synth_dataset(path, [SynthTable("item", 1_000_000, 1.1)], interactions=args.events, seed=1, mean_length=20)
        print(f"log: {args.events:,} events, batch {BATCH}, one step in {args.every} of an epoch read, "
              f"{args.rounds} rounds; load before the first round {os.getloadavg()[0]:.2f}")
        held, seconds, largest = {}, {t: [] for t in TRAINERS}, {}
        for r in range(args.rounds):
            for t in (TRAINERS if r % 2 == 0 else TRAINERS[::-1]):
                held[t], s, largest[t] = read_epoch(path, t, args.every)
                seconds[t].append(s)
        print(f"{'trainers':>8} {'held MB':>8} {'examples s: min':>16} {'median':>7} {'max':>6} "
              f"{'/ 1 trainer: min':>17} {'median':>7} {'max':>6} {'largest sub-batch: median':>26} {'max':>6}")
        for t in TRAINERS:
            ratio = [a / b for a, b in zip(seconds[t], seconds[1], strict=True)]
            print(f"{t:>8} {held[t] / 1e6:>8.1f} {min(seconds[t]):>16.1f} {np.median(seconds[t]):>7.1f} "
                  f"{max(seconds[t]):>6.1f} {min(ratio):>17.2f} {np.median(ratio):>7.2f} {max(ratio):>6.2f} "
                  f"{np.median(largest[t]):>26.3f} {largest[t].max():>6.3f}")


if __name__ == "__main__":
    main()

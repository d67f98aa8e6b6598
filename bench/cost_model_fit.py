"""Measured against predicted bytes per step, with the cost model's independent draws and with its
distinct rows fitted to real batches (shardflow/sharding/touch.py).

    python bench/cost_model_fit.py [--data sessions sasrec s3rec recbole] [--steps 6]

For each dataset (the bundled ones by importer name, and `sessions`: generated, 30% of
events repeating one of the user's last 5 items), every strategy plans the profile for
topologies/demo-4.yaml (batch 2,048, dim 32; table-wise at 300% memory slack so one device
holds the table, the others at 10%), and the in-process driver runs --steps steps of each
scope. Prints measured / predicted per cell, without the fit and with it. The figures are
exact counts of the bytes sent, not timings: the machine's load does not move them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from distributed import Client, LocalCluster

import shardflow.sharding.stage as sharding
from shardflow.data.synthetic import Repeats, SynthTable, synth_dataset
from shardflow.errors import InputError
from shardflow.planner.costmodel import StepShape
from shardflow.planner.topology import load_topology
from shardflow.profiling.profiles import profile_dataset
from shardflow.training.config import TrainConfig
from shardflow.training.run import in_process, prepare
from storage.importers import import_dataset

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
REAL = {"sasrec": DATA / "amazon-video" / "Video.txt", "s3rec": DATA / "amazon-beauty" / "Beauty.txt",
        "recbole": DATA / "movielens-100k" / "ml-100k.inter"}
SLACK = {"table-wise": 3.0, "row-wise-mod": 0.1, "row-wise-block": 0.1, "flexshard": 0.1}
BATCH, DIM = 2048, 32


def measured_over_predicted(ds: Path, plan: Path, dedup: str, steps: int) -> float:
    job = prepare(ds, plan, TrainConfig(batch_size=BATCH, dedup=dedup), mlp=(16,))
    driver = in_process(job)
    for i in range(steps):
        driver.step(0, i, i, 0)
    sent = sum(d.traffic().modeled_bytes for d in driver.devices) / steps
    return sent / job.predicted_bytes_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", default=["sessions", *REAL], choices=["sessions", *REAL])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    fit, topology = sharding.fit_touch, load_topology(ROOT / "topologies" / "demo-4.yaml")
    print("| data | strategy | scope | independent draws | fitted |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(n_workers=2, threads_per_worker=1) as cluster, \
            Client(cluster) as client:
        for name in args.data:
            root = Path(tmp) / name
            if name == "sessions":
                synth_dataset(root / "ds", [SynthTable("item", 20_000, 1.1)], interactions=300_000, seed=1,
                              mean_length=30, repeats=Repeats(0.3, 5))
            else:
                import_dataset(name, REAL[name], root / "ds")
            profile_dataset(root / "ds", root / "profile", client=client)
            for strategy, slack in SLACK.items():
                cells = {}
                for fitted in (False, True):
                    sharding.fit_touch = fit if fitted else (lambda *a, **k: {})
                    plan = root / f"{strategy}-{fitted}"
                    try:
                        sharding.make_plan(root / "profile", plan, topology, strategy=strategy,
                                           shape=StepShape(BATCH, DIM), memory_slack=slack)
                    except InputError as e:
                        print(f"| {name} | {strategy} | - | {e} | |", file=sys.stderr)
                        break
                    for dedup in ("none", "device", "node"):
                        cells.setdefault(dedup, []).append(measured_over_predicted(root / "ds", plan, dedup,
                                                                                   args.steps))
                for dedup, (plain, fitted) in cells.items():
                    print(f"| {name} | {strategy} | {dedup} | {plain:.3f} | {fitted:.3f} |", flush=True)
    sharding.fit_touch = fit


if __name__ == "__main__":
    main()

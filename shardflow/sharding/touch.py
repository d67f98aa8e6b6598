"""How many distinct rows real batches touch: the cost model's rates fitted to the data as it is.

The cost model (planner/costmodel.py) prices a row read remotely once per sub-batch that
reads it, and a replica's sync once per node or batch that reads it. Treating a step's
lookups as independent draws over-counts those distinct rows on real logs: an example's
history and its positive are one user's recent items, and sessions repeat items inside
them. Planning therefore samples real global batches of the planned size, split
over the planned devices as training splits them, counts each table's distinct rows per
trainer, per node and per batch, and fits one factor per level: the share of the lookups
that, drawn independently, would touch as many distinct rows (costmodel.Touch). The
per-class rates keep the profile's shape; the factor scales the lookups.

The sample uses its own seed, not a training seed: the model is checked on batches it
never saw.
"""

from __future__ import annotations

import numpy as np

from shardflow.data.batches import TrainData, negative_seed
from shardflow.data.clicks import ClickData, model_config
from shardflow.data.workload import Workload
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import Touch, touched
from shardflow.planner.topology import Topology
from storage.dataset import Dataset

SAMPLE_BATCHES = 8  # global batches sampled, spread over an epoch
SAMPLE_SEED = 0x5EED
FACTOR_RANGE = (2.0**-12, 4.0)


def fit_touch(dataset: Dataset, accesses: list[TableAccess], topology: Topology, batch_size: int, history: int,
              negatives: int, samples: int = SAMPLE_BATCHES, first: int = 0,
              validation: bool = False) -> dict[str, Touch]:
    """Per table, the Touch of `samples` real global batches of `batch_size` over `topology`'s trainers,
    drawn from the training window of parts `first` on, a validation split held out as training holds it;
    {} when the dataset has neither an item sequence nor click labels, or too few examples for one batch
    (independent draws)."""
    clicks = dataset.info.sequence_table is None
    if clicks and not dataset.info.labels:
        return {}
    config = model_config(dataset, dim=1, mlp=(1,), bottom=(1,), history=history, negatives=max(negatives, 1), seed=0)
    data: Workload = (ClickData if clicks else TrainData)(dataset, config.features, (first, 0), validation=validation)
    steps = data.steps_per_epoch(batch_size)
    if steps == 0 or batch_size < topology.devices:
        return {}
    names = [a.name for a in accesses if a.name in data.rows]
    distinct: dict[str, dict[str, list[int]]] = {
        t: {"trainer": [], "batch": [], **{f"node{n}": [] for n in topology.node_devices}} for t in names}
    for step in np.unique(np.linspace(0, steps - 1, min(samples, steps)).round().astype(int)).tolist():
        fetched = []
        for targets in data.sub_batches(data.batch(0, SAMPLE_SEED, step, batch_size), topology.devices):
            ex = data.examples(targets, config, negative_seed(SAMPLE_SEED, 0), negatives=negatives)
            fetched.append(data.lookups(ex, config, "device").fetch)
        for t in names:
            per_trainer = [f[t] for f in fetched]
            distinct[t]["trainer"] += [ids.size for ids in per_trainer]
            distinct[t]["batch"].append(np.unique(np.concatenate(per_trainer)).size)
            for start, n in zip(topology.node_start.tolist(), topology.node_devices.tolist(), strict=True):
                distinct[t][f"node{n}"].append(np.unique(np.concatenate(per_trainer[start : start + n])).size)
    touch = {}
    for a in accesses:
        if a.name not in distinct:
            continue
        m = a.lookups_per_example * batch_size / topology.devices
        seen = distinct[a.name]
        touch[a.name] = Touch(
            trainer=draws_factor(a, m, float(np.mean(seen["trainer"]))),
            node={int(n): draws_factor(a, m * n, float(np.mean(seen[f"node{n}"])))
                  for n in np.unique(topology.node_devices)},
            batch=draws_factor(a, m * topology.devices, float(np.mean(seen["batch"]))),
        )
    return touch


def draws_factor(access: TableAccess, lookups: float, distinct: float) -> float:
    """f such that f * `lookups` independent draws touch `distinct` rows in expectation (bisection: the
    expectation grows with f), clipped to FACTOR_RANGE."""
    def expected(f: float) -> float:
        return float((access.class_rows * touched(access, lookups * f)).sum())

    lo, hi = FACTOR_RANGE
    if expected(lo) >= distinct:
        return lo
    if expected(hi) <= distinct:
        return hi
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if expected(mid) < distinct else (lo, mid)
    return float((lo * hi) ** 0.5)

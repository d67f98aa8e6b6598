"""Training throughput on the bundled dataset: the engine on 1 and 2 devices beside single-process peers.

    python bench/train_throughput.py [--steps 20] [--batch-size 4096] [--epoch-auc]

Imports data/amazon-video into a scratch directory, plans it with FlexShard (10% memory
slack) for one node of 1 and of 2 devices, and measures in the same run, on the same
global batches (same example builder, order and negatives) and the same model
(dim 64, MLP 64-32, history 20, 4 negatives, row-wise Adagrad + Adam):
  - reference: shardflow's single-process numpy trainer (whole tables in one process);
  - pytorch:   the same model in PyTorch on the CPU (nn.EmbeddingBag mean pooling, the
               same MLP, BCE, row-wise Adagrad written on sparse gradients, Adam), one
               process using every core; only when torch is importable;
  - engine:    the Dask engine with one worker process per device (the cluster already
               started; its start-up is reported apart).
Each line is examples per second over --steps steps after 2 warm-up steps, the ratio to
the PyTorch peer (or to the reference without torch), and for the engine the step time
split into batch building, pull, compute, push and the sync rounds (slowest trainer).
With --epoch-auc the 2-device engine also trains one full epoch and reports
leave-last-out AUC and HR@10.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from shardflow.cluster import dask_client
from shardflow.model import ModelConfig
from shardflow.optim import OptimizerConfig
from shardflow.planner.access import TableAccess, sequence_lookups
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.strategies import budget_bytes_per_device, propose
from shardflow.planner.topology import uniform
from shardflow.training.batches import TrainData, negative_seed
from shardflow.training.engine import Engine, TrainConfig
from shardflow.training.reference import ReferenceTrainer
from storage.dataset import Dataset
from storage.importers import import_dataset

DATA = Path(__file__).resolve().parents[1] / "data" / "amazon-video" / "Video.txt"
MODEL = ModelConfig()
OPTIMIZER = OptimizerConfig()
WARMUP = 2


def plan_for(dataset: Path, devices: int, batch_size: int):
    ds = Dataset.open(dataset)
    per_example, uniform_share = sequence_lookups(ds.offsets(), MODEL.history, MODEL.negatives)
    rows = ds.info.table("item").rows
    access = [TableAccess.from_counts("item", np.bincount(ds.ids("item"), minlength=rows), per_example, uniform_share)]
    topo = uniform(1, devices, 12.5)
    model = CostModel(topo, StepShape(batch_size, MODEL.dim))
    return propose("flexshard", access, topo, budget_bytes_per_device(access, topo, MODEL.dim, 0.1), model), topo


def reference_rate(data: TrainData, batch_size: int, steps: int) -> float:
    ref = ReferenceTrainer(data, MODEL, OPTIMIZER, batch_size, seed=0)
    for i in range(WARMUP):
        ref.step(0, i)
    t = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        ref.step(0, i)
    return steps * batch_size / (time.perf_counter() - t)


def pytorch_rate(data: TrainData, batch_size: int, steps: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    from torch import nn

    rows = data.rows[data.item]
    D = MODEL.dim
    emb = nn.Parameter(torch.empty(rows, D).uniform_(-1 / D**0.5, 1 / D**0.5))
    row_state = torch.zeros(rows)
    widths = [3 * D, *MODEL.mlp]
    layers: list = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    mlp = nn.Sequential(*layers, nn.Linear(widths[-1], 1))
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=OPTIMIZER.dense_lr)
    order = data.epoch_order(0, 0)

    def step(i: int) -> None:
        targets = order[i * batch_size : (i + 1) * batch_size]
        ex = data.examples(targets, MODEL, negative_seed(0, 0))
        valid = ex.history >= 0
        flat = torch.from_numpy(ex.history[valid])
        offsets = torch.from_numpy(np.r_[0, np.cumsum(valid.sum(axis=1))[:-1]])
        cand = torch.from_numpy(np.concatenate([ex.positive[:, None], ex.negatives], axis=1))
        h = nn.functional.embedding_bag(flat, emb, offsets, mode="mean", sparse=True)
        t = nn.functional.embedding(cand, emb, sparse=True)
        hb = h[:, None, :].expand_as(t)
        logit = mlp(torch.cat([hb, t, hb * t], dim=2)).squeeze(-1)
        label = torch.zeros_like(logit)
        label[:, 0] = 1.0
        loss = nn.functional.binary_cross_entropy_with_logits(logit, label)
        dense_opt.zero_grad()
        emb.grad = None
        loss.backward()
        dense_opt.step()
        with torch.no_grad():
            g = emb.grad.coalesce()
            idx, val = g.indices()[0], g.values()
            acc = row_state[idx] + (val * val).mean(dim=1)
            row_state[idx] = acc
            emb[idx] -= OPTIMIZER.row_lr * val / (acc.sqrt()[:, None] + OPTIMIZER.eps)

    for i in range(WARMUP):
        step(i)
    t = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        step(i)
    return steps * batch_size / (time.perf_counter() - t)


def engine_rate(dataset: Path, devices: int, batch_size: int, steps: int, epoch_auc: bool) -> dict:
    plan, topo = plan_for(dataset, devices, batch_size)
    t = time.perf_counter()
    with dask_client(workers=devices) as client:
        startup = time.perf_counter() - t
        train = TrainConfig(batch_size=batch_size, max_steps=steps, eval_users=None)
        with Engine(client, str(dataset), plan, topo, MODEL, OPTIMIZER, train) as engine:
            for i in range(WARMUP):
                engine.step(1, i)  # warm-up on other batches than the measured ones
            result = engine.fit()
        out = {"rate": result.examples / result.seconds, "timings": result.timings, "startup": startup}
        if epoch_auc:
            full = TrainConfig(batch_size=batch_size, eval_users=None)
            with Engine(client, str(dataset), plan, topo, MODEL, OPTIMIZER, full) as engine:
                fit = engine.fit()
                out.update(engine.evaluate(), epoch_steps=fit.steps, epoch_s=fit.seconds, loss=fit.epoch_loss[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--epoch-auc", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        dataset = Path(scratch) / "amazon-video"
        import_dataset("sasrec", DATA, dataset)
        data = TrainData.load(dataset)
        B, n = args.batch_size, args.steps
        ref = reference_rate(data, B, n)
        peer = pytorch_rate(data, B, n)
        base, base_name = (peer, "pytorch") if peer else (ref, "reference")
        print(f"amazon-video: {data.targets.size:,} training examples, batch {B}, {n} steps after {WARMUP} warm-up")
        print(f"{'trainer':<22} {'examples/s':>11} {'vs ' + base_name:>12}   ms/step: batch   pull compute   push   sync")
        print(f"{'reference (1 process)':<22} {ref:>11,.0f} {ref / base:>11.2f}x")
        if peer:
            print(f"{'pytorch (1 process)':<22} {peer:>11,.0f} {1.0:>11.2f}x")
        else:
            print("pytorch                (torch not installed: peer skipped)")
        epoch = None
        for devices in (1, 2):
            e = engine_rate(dataset, devices, B, n, args.epoch_auc and devices == 2)
            t = e["timings"]
            split = "  ".join(f"{t[k] * 1e3:6.1f}" for k in ("batch", "pull", "compute", "push", "sync"))
            print(f"{f'engine, {devices} device(s)':<22} {e['rate']:>11,.0f} {e['rate'] / base:>11.2f}x   "
                  f"        {split}   (cluster start {e['startup']:.1f} s)")
            if "auc" in e:
                epoch = e
        if epoch:
            print(f"one epoch on 2 devices: {epoch['epoch_steps']} steps in {epoch['epoch_s']:.1f} s, loss "
                  f"{epoch['loss']:.4f}, AUC {epoch['auc']:.4f}, HR@10 {epoch['hr_at_10']:.4f} "
                  f"({epoch['users']:,} held-out users, {MODEL.negatives} negatives per example)")


if __name__ == "__main__":
    main()

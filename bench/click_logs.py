"""Click logs: the DLRM's held-out quality against logistic regression, and its training speed.

    python bench/click_logs.py [--rows 1000000] [--seeds 3] [--rounds 3] [--steps 20] [--movielens-steps 200]
                               [--batch-size 4096] [--skip-quality] [--skip-movielens] [--skip-traffic]
                               [--skip-throughput] [--throughput-logs both|synthetic|movielens]

Quality, on the bundled Criteo sample (200 rows) and Avazu sample (100 rows), imported
with 2^16-row hashed tables, and on a synthetic Criteo-layout log of --rows rows whose
labels come from a planted model with pairwise interactions (shardflow.data.synthetic_clicks):
every dataset's last 10% of rows are held out (the split shardflow evaluates on), and
  - constant: the training rows' click rate for every row;
  - logistic regression: one weight per (table, row) and per numeric input (log(1 + x)),
    a bias, L2 = 1e-3 on the mean log-loss, fitted to convergence by full-batch L-BFGS;
  - DLRM: shardflow's model (dim 16, bottom MLP 64, top MLP 64-32, row Adagrad 0.05 +
    Adam 1e-3), 3 epochs of batch 32 on the samples (15 steps), one epoch of batch 1,024
    on the synthetic log (click models overfit from the second epoch on: Zhang et al.,
    "Towards Understanding the Overfitting Phenomenon of Deep Click-Through Rate
    Prediction Models", CIKM 2022),
    trained by the single-process reference trainer, which the engine reproduces under
    any plan (tests/shardflow/training/test_clicks.py); --seeds initialisations and
    batch orders, min/median/max printed.
Both are fixed before looking at the held-out rows (no tuning on them). The samples
hold out 20 and 10 rows: their AUCs are worth little, and the table says so. Then, on
the samples, the DLRM's epochs chosen on a validation split of the training rows alone
(3, 10, 30 or 100): whether 3 epochs undertrain it against a regression fitted to
convergence.

MovieLens-100k as a click log: RecBole's atomic files imported with --label 'rating>=4'
(users' and movies' features joined, time-ordered), the last 10% held out and the 10% before
them a validation split; logistic regression with its L2 chosen on the validation log-loss
(shardflow.training.logistic.choose_l2) beside the run's default DLRM (batch 1,024) over 5
seeds, each stopped with patience 1 on the validation AUC and scored at its best epoch; the
margins per seed. Both with every table, and again without the movies' genres and title
words (tables of token sequences), to show what joining those buys.

Traffic, on all three over topologies/demo-4.yaml (2 nodes x 2 devices), dim 16, scope
device: every strategy planned from the dataset's profile (table-wise at 300% memory
slack, so that whole tables fit; the others at 10%), the cost model's bytes and time per
step beside the bytes the devices send in 6 steps (in process: the same messages as on a
cluster; the samples' epochs have 5 and 2 steps), and where flexshard and table-wise put
the tables.

Throughput, on the synthetic log (dim 16, --batch-size) and on MovieLens-100k (the run's
default DLRM, dim 64, batch 1,024 as its quality is measured): the engine on 1 and 2 devices
(FlexShard plan, 10% slack; the default transport, and on 2 devices the actor calls too) beside
its PyTorch peers: the same DLRM in one process with whole tables and sparse gradients (1 and 2
threads), and in 2 processes of one thread, data-parallel (bench/data_parallel_peer.py: one process per
device, as PyTorch's DistributedDataParallel; its parameters checked against the one process's),
alternating --rounds rounds, --steps steps (--movielens-steps on MovieLens, whose 5-10 ms
steps would make 20 a 0.15 s sample) after 2 warm-up steps each; min/median/max of examples/s and of the
ratios, with the load; and the engine's step in parts (ms, the slowest device's, medians over the rounds: building
the batch, the rounds, the forward and backward inside the reply's), with its compute on 2 devices ÷ on 1: how much
of a step halving each device's examples saves.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from data_parallel_peer import data_parallel_run, largest_difference  # this directory: one process per device
from train_throughput import WARMUP, pytorch_rate  # this directory: the sequence benchmark's PyTorch peer

from shardflow.cluster import dask_client
from shardflow.config import RetrainConfig
from shardflow.data.clicks import HELD_OUT, load_training_data, model_config
from shardflow.data.synthetic_clicks import synth_click_log
from shardflow.model.configs import ClickConfig, OptimizerConfig
from shardflow.model.forward import logits, on_device
from shardflow.model.metrics import log_loss, roc_auc
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.strategies import propose
from shardflow.planner.topology import load_topology, uniform
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine
from shardflow.training.logistic import choose_l2, constant_logloss, fit_logistic
from shardflow.training.reference import ReferenceTrainer
from shardflow.training.validation import best_epoch
from storage.dataset import Dataset
from storage.importers import import_dataset

DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLES = {"criteo-sample": DATA / "criteo-sample" / "criteo_sample.txt",
           "avazu-sample": DATA / "avazu-sample" / "avazu_sample.txt"}
# Synthetic tables: (values, Zipf alpha); three large, ten medium, thirteen small, as Criteo's spread.
SYNTH_TABLES = [(100_000, 1.1)] * 3 + [(1_000, 0.8)] * 10 + [(50, 0.5)] * 13
HASH_ROWS = 1 << 16
MOVIELENS = DATA / "movielens-100k" / "ml-100k.inter"
ML_LABEL, ML_BATCH, ML_EPOCHS, ML_PATIENCE = "rating>=4", 1024, 10, 1
DEMO = Path(__file__).resolve().parents[1] / "topologies" / "demo-4.yaml"
OPTIMIZER = OptimizerConfig()
LR_L2 = 1e-3


def model_for(ds: Dataset, seed: int) -> ClickConfig:
    return ClickConfig(dim=16, bottom=(64,), mlp=(64, 32), features=tuple(ds.info.table_names),
                       numeric=tuple(ds.info.dense), seed=seed)


def dlrm_quality(path: Path, batch: int, epochs: int, seed: int) -> tuple[float, float]:
    ds = Dataset.open(path)
    model = model_for(ds, seed)
    data = load_training_data(ds, model.features)
    ref = ReferenceTrainer(data, model, OPTIMIZER, batch, seed=seed)
    for epoch in range(epochs):
        for i in range(data.steps_per_epoch(batch)):
            ref.step(epoch, i)
    ex = data.examples(data.eval_targets, model)
    with torch.no_grad():
        index = on_device(data.table_index(ex, model), torch.device("cpu"))
        logit = logits(model, ref.dense_tensors, ref.tables, index)
    return roc_auc(logit.numpy(), ex.labels), log_loss(logit.numpy(), ex.labels)


def lr_quality(path: Path) -> tuple[tuple[float, float], tuple[float, float]]:
    """((AUC, log-loss) of logistic regression (L2 = 1e-3), of the constant training click rate)."""
    ds = Dataset.open(path)
    model = model_for(ds, 0)
    data = load_training_data(ds, model.features)
    lr = fit_logistic(data, model, LR_L2).evaluate(data, data.eval_targets, model)
    return (lr.auc, lr.logloss), (0.5, constant_logloss(data, model))


def spread(values: list[float], digits: int = 4) -> str:
    return f"{min(values):.{digits}f} / {float(np.median(values)):.{digits}f} / {max(values):.{digits}f}"


def quality(scratch: Path, synthetic: Path, seeds: int) -> None:
    print(f"\nheld-out quality (last 10% of rows); DLRM min / median / max over {seeds} seeds")
    print(f"{'dataset':<22} {'held out':>8} {'CTR':>6}  {'':<8} {'AUC':>24} {'log-loss':>24}")
    sets = {name: (scratch / name, 32, 3) for name in SAMPLES}
    sets["synthetic"] = (synthetic, 1024, 1)
    for name, (path, batch, epochs) in sets.items():
        ds = Dataset.open(path)
        data = load_training_data(ds, tuple(ds.info.table_names))
        labels = ds.column("labels")[data.eval_start:]
        (lr_auc, lr_ll), (_, const_ll) = lr_quality(path)
        runs = [dlrm_quality(path, batch, epochs, s) for s in range(seeds)]
        head = f"{name:<22} {labels.size:>8,} {labels.mean():>6.3f}"
        print(f"{head}  {'constant':<8} {'0.5':>24} {const_ll:>24.4f}")
        print(f"{'':<38}  {'LR':<8} {lr_auc:>24.4f} {lr_ll:>24.4f}")
        print(f"{'':<38}  {'DLRM':<8} {spread([r[0] for r in runs]):>24} {spread([r[1] for r in runs]):>24}")


ML_SEQUENCES = ("class", "movie_title")  # the movies' genres and title words: RecBole token_seq fields


def run_default(ds: Dataset, seed: int) -> ClickConfig:
    """The DLRM `shardflow run` trains on a click log by default."""
    defaults = RetrainConfig().model
    return model_config(ds, dim=defaults.dim, mlp=defaults.mlp, bottom=defaults.bottom_mlp, history=1,
                        negatives=1, seed=seed)


def movielens(path: Path, seeds: int) -> None:
    """MovieLens-100k as a click log: the DLRM's held-out AUC and log-loss beside logistic regression's, with
    every table and again without the tables of token sequences (what joining them buys)."""
    ds = Dataset.open(path)
    every = [run_default(ds, s) for s in range(seeds)]
    labels = ds.column("labels")
    print(f"\nMovieLens-100k as a click log ({ML_LABEL} a click, click rate {labels.mean():.3f}); tables "
          f"{', '.join(ds.info.table_names)} ({', '.join(f'{t} up to {w} ids' for t, w in ds.info.widths.items())})")
    print(f"{'model':<44} {'epochs':>10} {'AUC':>24} {'log-loss':>24} {'s':>6}")
    for label, models in (("every table", every),
                          (f"without {', '.join(ML_SEQUENCES)}",
                           [replace(m, features=tuple(t for t in m.features if t not in ML_SEQUENCES))
                            for m in every])):
        data = load_training_data(ds, models[0].features, validation=True)
        print(f"{label}: {data.targets:,} training, {data.validation_targets.size:,} validation and "
              f"{data.eval_targets.size:,} held-out rows in time order")
        started = time.perf_counter()
        l2, tuned = choose_l2(data, models[0])
        lr = tuned.evaluate(data, data.eval_targets, models[0])
        lr_s = time.perf_counter() - started
        runs = []
        for model in models:
            started = time.perf_counter()
            trainer = ReferenceTrainer(data, model, OPTIMIZER, ML_BATCH, seed=model.seed)
            epoch = best_epoch(trainer.fit(ML_EPOCHS, ML_PATIENCE))
            runs.append((epoch, trainer.evaluate(data.eval_targets), time.perf_counter() - started))
        print(f"{'  constant (training click rate)':<44} {'':>10} {'0.5':>24} "
              f"{constant_logloss(data, models[0]):>24.4f}")
        print(f"{f'  logistic regression, L2 {l2:g}':<44} {'':>10} {lr.auc:>24.4f} {lr.logloss:>24.4f} {lr_s:>6.0f}")
        auc, ll = [r[1].auc for r in runs], [r[1].logloss for r in runs]
        print(f"{f'  DLRM, {seeds} seeds':<44} {spread([r[0] for r in runs], 0):>10} {spread(auc):>24} "
              f"{spread(ll):>24} {float(np.median([r[2] for r in runs])):>6.0f}")
        print(f"{'  DLRM minus regression':<44} {'':>10} {spread([a - lr.auc for a in auc], 4):>24} "
              f"{spread([x - lr.logloss for x in ll], 4):>24}")


VALIDATION_EPOCHS = (3, 10, 30, 100)


def epochs_on_validation(scratch: Path, seeds: int) -> None:
    """Whether the samples' 3 epochs undertrain the DLRM: each sample's training rows alone (the first 90%)
    imported as a dataset of their own, whose last 10% is then a validation split; the epochs of least
    median validation log-loss, and the held-out figures at each count."""
    print(f"\nDLRM epochs on the samples, chosen on a validation split (the last 10% of the training rows); "
          f"medians over {seeds} seeds")
    print(f"{'dataset':<16} {'epochs':>6} {'val AUC':>8} {'val log-loss':>13} {'held-out AUC':>13} {'log-loss':>9}")
    for name, src in SAMPLES.items():
        lines = src.read_text().splitlines()  # a header line, then the rows
        train = len(lines) - 1 - int(np.ceil(HELD_OUT * (len(lines) - 1)))
        (scratch / f"{name}-train.csv").write_text("\n".join(lines[: 1 + train]) + "\n")
        import_dataset("criteo", scratch / f"{name}-train.csv", scratch / f"{name}-train", hash_rows=HASH_ROWS)
        chosen, best = None, np.inf
        for epochs in VALIDATION_EPOCHS:
            val = np.median([dlrm_quality(scratch / f"{name}-train", 32, epochs, s) for s in range(seeds)], axis=0)
            test = np.median([dlrm_quality(scratch / name, 32, epochs, s) for s in range(seeds)], axis=0)
            print(f"{name:<16} {epochs:>6} {val[0]:>8.4f} {val[1]:>13.4f} {test[0]:>13.4f} {test[1]:>9.4f}")
            if val[1] < best:
                chosen, best = epochs, val[1]
        print(f"{name:<16} chosen: {chosen} epochs")


TRAFFIC_SLACK = {"table-wise": 3.0, "row-wise-mod": 0.1, "row-wise-block": 0.1, "flexshard": 0.1}
TRAFFIC_STEPS = 6


def traffic(scratch: Path, synthetic: Path, batch: int) -> None:
    from shardflow.planner.report import table_tiers
    from shardflow.profiling.profiles import profile_dataset
    from shardflow.sharding.stage import make_plan, read_plan
    from shardflow.training.run import in_process, prepare

    topology = load_topology(DEMO)
    print(f"\ntraffic per step on {DEMO.name}, dim 16, scope device (the first {TRAFFIC_STEPS} steps of an epoch, or "
          "all of them, measured in process)")
    print(f"{'dataset':<16} {'batch':>6} {'strategy':<15} {'modeled MB':>11} {'measured MB':>12} {'ratio':>6} "
          f"{'comm µs':>8}")
    with dask_client(workers=2) as client:
        for name, path, b in [(n, scratch / n, 32) for n in SAMPLES] + [("synthetic", synthetic, batch)]:
            profile_dataset(path, scratch / f"{name}.profile", client=client)
            plans = {}
            for strategy, slack in TRAFFIC_SLACK.items():
                out = scratch / f"{name}.{strategy}"
                s = make_plan(scratch / f"{name}.profile", out, topology, strategy=strategy,
                              shape=StepShape(b, 16, "device"), memory_slack=slack)
                job = prepare(path, out, TrainConfig(batch_size=b, dedup="device"), mlp=(64, 32))
                driver = in_process(job)
                steps = min(TRAFFIC_STEPS, driver.devices[0].data.steps_per_epoch(b))  # whole batches only
                for i in range(steps):
                    driver.step(0, i, i, 0)
                sent = sum(d.traffic().modeled_bytes for d in driver.devices)
                measured = sent / steps
                print(f"{name:<16} {b:>6,} {strategy:<15} {job.predicted_bytes_per_step / 1e6:>11.4f} "
                      f"{measured / 1e6:>12.4f} {measured / job.predicted_bytes_per_step:>6.3f} "
                      f"{s.comm_time_s_per_step * 1e6:>8.2f}")
                plans[strategy] = read_plan(out).plan
            tiers = table_tiers({k: plans[k] for k in ("table-wise", "flexshard")}, topology)
            print(f"  {name} tables (table-wise | flexshard): "
                  + "; ".join(f"{r['table']} {r['table-wise']} | {r['flexshard']}" for r in tiers[:6])
                  + (f"; ... {len(tiers) - 6} more" if len(tiers) > 6 else ""))


def plan_for(path: Path, devices: int, batch: int, dim: int):
    ds = Dataset.open(path)
    ids = {t: ds.ids(t).ravel() for t in ds.info.table_names}  # a token sequence's padding is -1
    access = [TableAccess.from_counts(t, np.bincount(v[v >= 0], minlength=ds.info.table(t).rows), 1.0)
              for t, v in ids.items()]
    topo = uniform(1, devices, 12.5)
    model = CostModel(topo, StepShape(batch, dim))
    return propose("flexshard", access, topo, budget_bytes_per_device(access, topo, dim, 0.1), model), topo


def throughput(name: str, path: Path, model: ClickConfig, rounds: int, steps: int, batch: int) -> None:
    ds = Dataset.open(path)
    data = load_training_data(ds, model.features)
    plans = {d: plan_for(path, d, batch, model.dim) for d in (1, 2)}
    cores = os.cpu_count() or 1
    idle = os.getloadavg()[0]
    print(f"\nthroughput on {name}: dim {model.dim}, batch {batch}, {steps} steps after {WARMUP} warm-up, {rounds} "
          f"rounds, {cores} cores, torch {torch.__version__}; load before the first round {idle:.2f}"
          + (f" (not quiet: above {cores / 2:.1f})" if idle > cores / 2 else ""))
    print(f"pytorch, 2 processes: its parameters after {WARMUP} steps differ from the reference trainer's by "
          f"{largest_difference(path, model, OPTIMIZER, batch, WARMUP):.1e} at most")
    rates: dict[str, list[float]] = {}
    parts: dict[str, list[dict[str, float]]] = {}  # engine -> its step's parts (s), round by round
    loads = []
    with dask_client(workers=1) as one, dask_client(workers=2) as two:
        clients = {1: one, 2: two}
        for _ in range(rounds):
            loads.append(os.getloadavg()[0])
            for devices, transport, trainer in ((1, "auto", "engine, 1 device(s)"), (2, "auto", "engine, 2 device(s)"),
                                                (2, "actor", "engine, 2, actor")):
                train = TrainConfig(batch_size=batch, max_steps=WARMUP + steps, eval_users=None, transport=transport,
                                    epochs=-(-(WARMUP + steps) // data.steps_per_epoch(batch)))
                with Engine(clients[devices], str(path), *plans[devices], model, OPTIMIZER, train) as engine:
                    fitted = engine.fit()
                rates.setdefault(trainer, []).append(fitted.examples_per_s)
                parts.setdefault(trainer, []).append(fitted.timings)
            for threads in (1, 2):
                rates.setdefault(f"pytorch, {threads} thread(s)", []).append(
                    pytorch_rate(data, model, batch, steps, threads))
            rates.setdefault("pytorch, 2 processes", []).append(
                data_parallel_run(path, model, OPTIMIZER, batch, WARMUP, steps)[0])
    print(f"load {min(loads):.2f}-{max(loads):.2f} at the rounds' starts")
    print(f"{'trainer':<24} {'examples/s: min':>15} {'median':>9} {'max':>9}")
    for trainer, v in rates.items():
        print(f"{trainer:<24} {min(v):>15,.0f} {float(np.median(v)):>9,.0f} {max(v):>9,.0f}")
    e1, e2 = rates["engine, 1 device(s)"], rates["engine, 2 device(s)"]
    p1, p2, dp = rates["pytorch, 1 thread(s)"], rates["pytorch, 2 thread(s)"], rates["pytorch, 2 processes"]
    print(f"\n{'ratio (per round)':<38} {'min / median / max':>24}")
    for ratio, v in {"engine 2 devices / pytorch 2 threads": [a / b for a, b in zip(e2, p2, strict=True)],
                     "engine 2 devices / pytorch 2 processes": [a / b for a, b in zip(e2, dp, strict=True)],
                     "pytorch 2 processes / 2 threads": [a / b for a, b in zip(dp, p2, strict=True)],
                     "collective / actor, 2 devices": [a / b for a, b in zip(e2, rates["engine, 2, actor"],
                                                                             strict=True)],
                     "engine 1 device / pytorch 1 thread": [a / b for a, b in zip(e1, p1, strict=True)],
                     "engine 2 devices / engine 1 device": [a / b for a, b in zip(e2, e1, strict=True)]}.items():
        print(f"{ratio:<38} {spread(v, 2):>24}")
    step_parts(parts)


def step_parts(parts: dict[str, list[dict[str, float]]]) -> None:
    """The engines' steps in parts (ms, medians over the rounds), and compute on 2 devices ÷ on 1 per round."""
    names = list(dict.fromkeys(n for runs in parts.values() for t in runs for n in t))
    print(f"\n{'step parts, ms (median)':<24}" + "".join(f" {n:>9}" for n in names))
    for trainer, runs in parts.items():
        print(f"{trainer:<24}" + "".join(f" {float(np.median([t.get(n, 0.0) for t in runs])) * 1e3:>9.2f}"
                                         for n in names))
    one, two = parts["engine, 1 device(s)"], parts["engine, 2 device(s)"]
    ratios = [b["compute"] / a["compute"] for a, b in zip(one, two, strict=True)]
    print(f"compute, 2 devices ÷ 1 (per round): {spread(ratios, 2)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--movielens-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-movielens", action="store_true")
    parser.add_argument("--skip-traffic", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--throughput-logs", choices=("both", "synthetic", "movielens"), default="both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-") as scratch:
        scratch = Path(scratch)
        for name, src in SAMPLES.items():
            import_dataset("criteo", src, scratch / name, hash_rows=HASH_ROWS)
        synthetic = scratch / "synthetic"
        import_dataset("criteo", synth_click_log(scratch / "synthetic.csv", args.rows, SYNTH_TABLES, seed=1),
                       synthetic, hash_rows=HASH_ROWS)
        print(f"synthetic log: {args.rows:,} rows, {len(SYNTH_TABLES)} tables hashed into {HASH_ROWS:,} rows, "
              f"13 numeric columns, click rate {Dataset.open(synthetic).column('labels').mean():.3f}")
        if not args.skip_quality:
            quality(scratch, synthetic, args.seeds)
            epochs_on_validation(scratch, args.seeds)
        ml = scratch / "movielens"
        if not args.skip_movielens or (not args.skip_throughput and args.throughput_logs != "synthetic"):
            import_dataset("recbole", MOVIELENS, ml, label=ML_LABEL)
        if not args.skip_movielens:
            movielens(ml, 5)
        if not args.skip_traffic:
            traffic(scratch, synthetic, args.batch_size)
        if not args.skip_throughput and args.throughput_logs != "movielens":
            throughput("the synthetic log", synthetic, model_for(Dataset.open(synthetic), 0), args.rounds,
                       args.steps, args.batch_size)
        if not args.skip_throughput and args.throughput_logs != "synthetic":
            throughput(f"MovieLens-100k ({ML_LABEL} a click), the run's default DLRM", ml,
                       run_default(Dataset.open(ml), 0), args.rounds, args.movielens_steps, ML_BATCH)


if __name__ == "__main__":
    main()

"""Model quality: HR@10 and NDCG@10 among sampled items and among the whole catalog, beside published figures.

    python bench/model_quality.py [--datasets games,beauty,movielens,FORMAT:PATH] [--encoders self-attention,mean]
                                  [--epochs 200] [--seeds 0,1,2] [--batch-size 4096] [--history 50] [--dropout 0.2]
                                  [--item-dropout 0.2]
                                  [--patience 10 [--min-epochs M] [--full-ranking exclude-seen|include-seen|off]]
                                  [--row-optimizer adam|adagrad] [--row-lr RATE]
                                  [--negatives 256] [--loss gbce|sampled-softmax|bce [--gbce-t 0.75]] [--blocks 1]
                                  [--devices 2] [--device cpu|cuda]

Every default is the run's (shardflow.config.RetrainConfig for a sequence log): without flags it measures the
model `shardflow run` trains.

For each dataset, encoder and seed: import the bundled log, plan it with FlexShard for one node
of --devices devices (10% memory slack), and train the run's default model (shardflow.config.RetrainConfig)
with that encoder — the mean of the history rows into an MLP, or SASRec's self-attention blocks
(shardflow/model/attention.py) — on the Dask engine, one worker per device, for --epochs epochs
(computing on --device: cuda places every worker on the machine's GPUs in turn).
After every epoch all users are evaluated as the paper does (Kang & McAuley, ICDM 2018,
section IV-B): the held-out last item ranked among 100 items the user never interacted with
(shardflow.data.examples.sample_unseen). Without --patience the epoch count is fixed in
advance and the figure reported is the last epoch's (--patience 0). With --patience N, as the paper does,
each user's second-to-last item is held out as a validation split too, scored after every
epoch and ranked among the whole catalog where the rows live (Engine.validate; --full-ranking
off: sampled only); training stops N epochs after the best validation NDCG@10 of the whole
catalog (the sampled one with off; not before epoch M, with --min-epochs M) and the figure
reported is the test split's at that best epoch (the test item chooses nothing). Either way:
min/median/max over the seeds, and the medians over the published figures (ratios). The
per-epoch rows are printed as a learning curve. The model reported (the last epoch's, or the
best validation epoch's) is exported and its held-out items are also ranked among the whole
catalog, the items each user had before left out (shardflow.model.ranking; the eSASRec
benchmark's filter_viewed), printed beside the full-ranking figures published on the same data.

Published figures on the same data:
  games   (data/amazon-video, the paper's "Amazon Games": 31,013 users, 23,715 items):
          SASRec HR@10 0.7410, NDCG@10 0.5360 (the paper's Table III);
  beauty  (data/amazon-beauty, the 5-core Beauty of the S3Rec papers, 22,363 users): SASRec with
          the paper's settings run independently on this copy, 0.5157 / 0.3479 (issue 31);
          the paper's 0.4854 is on a sparser Beauty and does not apply.
  full catalog, seen items excluded (eSASRec benchmark, github blondered/transformer_benchmark, README;
          dim 64, 1 block, 1 head, 50 items of history, sampled softmax over 256 negatives):
  beauty  SASRec with sampled softmax HR@10 0.0921, NDCG@10 0.0531; eSASRec 0.0928 / 0.0523;
  games   no published full-ranking figure known.
  movielens (data/movielens-100k, every rating in time order: 943 users, 1,682 items): no figure; kept
          to try a setup chosen on games and beauty on a log it was not chosen on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from sequence_logs import parse_logs  # bench/ is on sys.path: this runs as a script beside it
from train_throughput import plan_for

from shardflow.cluster import dask_client
from shardflow.config import RetrainConfig
from shardflow.data.batches import TrainData
from shardflow.errors import InputError
from shardflow.model.configs import LOSSES, ModelConfig, OptimizerConfig
from shardflow.model.metrics import FULL_RANKING
from shardflow.planner.sharding_plan import ROW_OPTIMIZERS
from shardflow.training.config import TrainConfig
from shardflow.training.device import DEVICES, torch_device
from shardflow.training.engine import Engine
from shardflow.training.evaluate import evaluate_export
from shardflow.training.validation import best_epoch, epoch_scores, stop_now
from storage.importers import import_dataset

PUBLISHED = {  # name -> sampled HR@10, NDCG@10 published on the bundled log, where they come from
    "games": (0.7410, 0.5360, "SASRec, the paper's Table III"),
    "beauty": (0.5157, 0.3479, "SASRec run on this copy"),
    "movielens": (None, None, "none known: a log no setup here was chosen on"),
}
FORMATS = ("sasrec", "s3rec", "recbole")  # the sequence logs shardflow import reads
FULL_ANCHORS = {  # name -> full-catalog HR@10, NDCG@10 (seen items excluded), the best of each published column
    "beauty": (0.0928, 0.0531, "eSASRec / SASRec+SS (eSASRec benchmark)"),
}


def run(client, dataset: Path, model: ModelConfig, optimizer: OptimizerConfig, train: TrainConfig,
        devices: int, export: Path) -> list[dict]:
    """Every epoch's loss, metrics and seconds (training, then evaluating all users), up to the epoch reported
    (with a patience: the best on the validation split, which is the last row, whose full-catalog figures are
    added: the reported epoch's model is exported to `export` and ranked there)."""
    plan, topo = plan_for(dataset, devices, train.batch_size, model)
    patience = train.patience
    rows, scores = [], {}
    with Engine(client, str(dataset), plan, topo, model, optimizer, train) as engine:
        for epoch in range(1, train.epochs + 1):
            e = engine.train_epoch(epoch - 1)
            t = time.perf_counter()
            metrics = engine.evaluate()
            held = engine.validate() if patience else {}
            rows.append({"epoch": epoch, "loss": e.loss, "train_s": e.seconds,
                         "eval_s": time.perf_counter() - t, **metrics.values(), "users": metrics.users, **held})
            full = held.get("val_full_ndcg_at_10")
            chosen = (f"  validation NDCG@10 {held['val_ndcg_at_10']:.4f}" if held else "") + (
                "" if full is None else f", whole catalog {full:.4f}")
            print(f"    epoch {epoch:3d}: loss {e.loss:.4f}  HR@10 {metrics.hr_at_10:.4f}  NDCG@10 "
                  f"{metrics.ndcg_at_10:.4f}  AUC {metrics.auc:.4f}{chosen}  ({e.seconds:.0f} s + "
                  f"{rows[-1]['eval_s']:.0f} s eval, load {os.getloadavg()[0]:.1f})", flush=True)
            if held:
                scores = epoch_scores({r["epoch"]: r for r in rows})
                if best_epoch(scores) == epoch:
                    engine.export(export, epoch)
                if stop_now(scores, patience, train.min_epochs):
                    break
        if not held:
            engine.export(export, len(rows))
    reported = rows[: best_epoch(scores)] if scores else rows
    t = time.perf_counter()
    full = evaluate_export(export, dataset, None, train.seed, full="exclude-seen", client=client)
    reported[-1].update(full.values(full=True), full_s=time.perf_counter() - t)
    print(f"    epoch {reported[-1]['epoch']:3d} over the whole catalog, seen items excluded: HR@10 "
          f"{full.full_hr_at_10:.4f}  NDCG@10 {full.full_ndcg_at_10:.4f}  HR@20 {full.full_hr_at_20:.4f}  NDCG@20 "
          f"{full.full_ndcg_at_20:.4f}  ({reported[-1]['full_s']:.0f} s)", flush=True)
    return reported


def beside(hrs: list[float], ndcgs: list[float], hr: float | None, ndcg: float | None, width: int) -> str:
    """A published HR@10 and NDCG@10 (the first `width` columns wide) and the seeds' medians over them, or blanks
    of the same width where none is known."""
    if hr is None or ndcg is None:
        return f"{'':{width}} {'':8} {'':11}"
    return f"{hr:{width}.4f} {ndcg:8.4f} {statistics.median(hrs) / hr:5.2f} {statistics.median(ndcgs) / ndcg:5.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(PUBLISHED),
                        help=f"{', '.join(PUBLISHED)}, or FORMAT:PATH of another log (FORMAT: {', '.join(FORMATS)})")
    parser.add_argument("--epochs", type=int, default=RetrainConfig().train.epochs)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--batch-size", type=int, default=RetrainConfig().train.batch_size)
    parser.add_argument("--encoders", default=RetrainConfig().model.encoder)
    parser.add_argument("--history", type=int, default=RetrainConfig().model.history)
    parser.add_argument("--dropout", type=float, default=RetrainConfig().model.dropout)
    parser.add_argument("--item-dropout", type=float, default=RetrainConfig().model.item_dropout)
    parser.add_argument("--patience", type=int, default=RetrainConfig().train.patience,
                        help="choose the epoch on a validation split (0: none, the last epoch)")
    parser.add_argument("--min-epochs", type=int, help="with --patience: train at least this many epochs")
    parser.add_argument("--full-ranking", choices=FULL_RANKING, default=RetrainConfig().train.full_ranking,
                        help="with --patience: rank the validation split among the whole catalog after every epoch "
                        "and choose on it (off: on the sampled NDCG@10)")
    parser.add_argument("--row-optimizer", choices=ROW_OPTIMIZERS, default=RetrainConfig().train.row_optimizer)
    parser.add_argument("--row-lr", type=float, help="the rows' rate (default: the row optimizer's, ROW_LR)")
    parser.add_argument("--negatives", type=int, default=RetrainConfig().model.negatives,
                        help="sampled negatives per training target")
    parser.add_argument("--loss", choices=LOSSES, default=RetrainConfig().model.loss)
    parser.add_argument("--gbce-t", type=float, default=RetrainConfig().model.gbce_t,
                        help="with --loss gbce: the calibration t")
    parser.add_argument("--blocks", type=int, default=RetrainConfig().model.attention_blocks,
                        help="self-attention blocks")
    parser.add_argument("--beta2", type=float, default=OptimizerConfig.beta2,
                        help="Adam's second-moment decay, rows and dense layers (RecTools' SASRec: 0.98)")
    parser.add_argument("--dim", type=int, default=RetrainConfig().model.dim, help="embedding width")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    args = parser.parse_args()
    logs = parse_logs(args.datasets, list(PUBLISHED), FORMATS)
    seeds = [int(s) for s in args.seeds.split(",")]
    models = {}
    try:  # refused here, before any work: no GPU visible, or a bad value
        torch_device(args.device)
        train = TrainConfig(batch_size=args.batch_size, epochs=args.epochs, eval_users=None,
                            patience=args.patience or None, min_epochs=args.min_epochs, device=args.device,
                            full_ranking=args.full_ranking)
        for encoder in args.encoders.split(","):
            config = RetrainConfig.build({"encoder": encoder, "history": args.history, "dropout": args.dropout,
                                          "item_dropout": args.item_dropout, "negatives": args.negatives,
                                          "loss": args.loss, "gbce_t": args.gbce_t,
                                          "attention_blocks": args.blocks, "dim": args.dim})
            c = config.model
            models[encoder] = ModelConfig(dim=c.dim, mlp=c.mlp, history=c.history, negatives=c.negatives,
                                          **config.encoder_options())
        optimizer = replace(RetrainConfig.build({"row_lr": args.row_lr, "row_optimizer": args.row_optimizer})
                            .optimizer(), beta2=args.beta2)
    except InputError as e:
        raise SystemExit(f"model_quality: {e}") from None
    print(f"load before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.devices} {args.device} devices; "
          f"batch {args.batch_size}; {args.epochs} epochs; seeds {seeds}; dim {c.dim}, history {c.history}, "
          f"{c.negatives} negatives, {args.loss}{f' t {c.gbce_t}' if args.loss == 'gbce' else ''}; mean: MLP "
          f"{list(c.mlp)}; self-attention: {c.attention_blocks} blocks, {c.attention_heads} heads, dropout "
          f"{c.dropout}, item rows {c.item_dropout}; rows {optimizer.rows} "
          f"{optimizer.row_lr}, dense {optimizer.dense} {optimizer.dense_lr}, Adam beta2 {optimizer.beta2}", flush=True)
    results: dict[tuple[str, str], list[list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        for name, (source, fmt) in logs.items():  # every log imported before any cluster starts
            try:
                import_dataset(fmt, source, Path(tmp) / name)
            except InputError as e:
                raise SystemExit(f"model_quality: {e}") from None
        with dask_client(workers=args.devices) as client:
            for name in logs:
                store = Path(tmp) / name
                data = TrainData.load(store)
                print(f"{name}: {data.targets:,} training examples, {data.eval_targets.size:,} users evaluated",
                      flush=True)
                for encoder, model in models.items():
                    for seed in seeds:
                        print(f"  {encoder}, seed {seed}", flush=True)
                        results.setdefault((name, encoder), []).append(
                            run(client, store, model, optimizer, replace(train, seed=seed), args.devices,
                                Path(tmp) / f"{name}-{encoder}-{seed}-model"))
    print(f"\nload after: {os.getloadavg()[0]:.1f}")
    fmt3 = lambda v: f"{v[0]:.4f}/{statistics.median(v):.4f}/{v[-1]:.4f}"  # noqa: E731
    print(f"{'dataset':9} {'encoder':14} {'epochs':>9} {'HR@10 min/median/max':>22} {'NDCG@10 min/median/max':>24}"
          f" {'paper HR@10':>11} {'NDCG@10':>8} {'ratios':>11} {'train s/epoch':>13}  published")
    for (name, encoder), runs in results.items():
        hr, ndcg, where = PUBLISHED.get(name, (None, None, "none known"))
        last = [r[-1] for r in runs]
        spread = {k: sorted(x[k] for x in last) for k in ("hr_at_10", "ndcg_at_10")}
        per_epoch = statistics.median(row["train_s"] for r in runs for row in r)
        chosen = "/".join(str(r[-1]["epoch"]) for r in runs)  # per seed: the epoch reported
        paper = beside(spread["hr_at_10"], spread["ndcg_at_10"], hr, ndcg, 11)
        print(f"{name:9} {encoder:14} {chosen:>9} {fmt3(spread['hr_at_10']):>22} {fmt3(spread['ndcg_at_10']):>24}"
              f" {paper} {per_epoch:13.1f}  {where}")
    print("\nthe whole catalog, seen items excluded (every user's held-out item against every item)")
    print(f"{'dataset':9} {'encoder':14} {'HR@10 min/median/max':>22} {'NDCG@10 min/median/max':>24}"
          f" {'HR@20 median':>12} {'NDCG@20':>8} {'anchor HR@10':>12} {'NDCG@10':>8} {'ratios':>11}  published")
    for (name, encoder), runs in results.items():
        last = [r[-1] for r in runs]
        spread = {k: sorted(x[k] for x in last) for k in ("full_hr_at_10", "full_ndcg_at_10", "full_hr_at_20",
                                                          "full_ndcg_at_20")}
        hr, ndcg, where = FULL_ANCHORS.get(name, (None, None, "none known"))
        anchor = beside(spread["full_hr_at_10"], spread["full_ndcg_at_10"], hr, ndcg, 12)
        print(f"{name:9} {encoder:14} {fmt3(spread['full_hr_at_10']):>22} {fmt3(spread['full_ndcg_at_10']):>24}"
              f" {statistics.median(spread['full_hr_at_20']):12.4f} {statistics.median(spread['full_ndcg_at_20']):8.4f}"
              f" {anchor}  {where}")


if __name__ == "__main__":
    main()

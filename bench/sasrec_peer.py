"""A peer for the sequence model's whole-catalog figures: SASRec with a sampled softmax (SASRec+SS) trained as the
eSASRec benchmark trains it, in one plain PyTorch process, on the same split and with the same metric.

    python bench/sasrec_peer.py [--datasets beauty,games,FORMAT:PATH] [--seeds 0,1,2] [--epochs 200] [--patience 50]
                                [--threads 2] [--dim 64] [--item-dropout]

The full-ranking anchors of bench/model_quality.py (Beauty: HR@10 0.0921, NDCG@10 0.0531 for SASRec+SS) were
measured by github blondered/transformer_benchmark with RecTools' SASRecModel on a GPU. This bench is that recipe
written out here, so that the engine's figures stand beside a peer run on this machine, on this copy of the log:

  model     RecTools' SASRec (rectools/models/nn/transformers/sasrec.py, net_blocks.py, torch_backbone.py):
            item row + learned position (no sqrt(dim) scale), dropout, padding zeroed; per block q = LN(e),
            e = q + attention(q, e, e) (dropout on its weights; padded keys not masked, as RecTools' default),
            f = LN(e), e = f + dropout(W2 relu(dropout(W1 f))), padding zeroed; a last LN (eps 1e-8);
            logit = state . item row. Every matrix Xavier-normal (lightning.py, _xavier_normal_init).
            With --item-dropout, as RecTools 0.13.0 (the benchmark's pin) trains it: each step drops out units
            of the whole item table once (item_net.py, IdEmbeddingsItemNet's dropout, taken out in RecTools
            0.16), and the step's history and candidates read those rows.
  training  each user's items but its last two (the test and validation items), the last 51 of them, every
            position a target; 128 users a step; 256 negatives uniform over the catalog per position, the
            positive's cross-entropy against them; Adam, lr 1e-3, betas (0.9, 0.98), over every parameter
            (dense, as torch.optim.Adam over an nn.Embedding). The settings are the benchmark's for Beauty
            (its README: dim 64, 1 block, 1 head, dropout 0.2, 50 items, 256 negatives); Games uses the same.
            The repository's leave-one-out configs, which the README's S3Rec-copy columns come from
            (configs/paper/loo/s3_vanilla.yaml for SASRec+SS, s3_beauty_ligr.yaml for eSASRec), set
            n_factors 256 instead: --dim 256 runs that.
  selection after every epoch, each user's second-to-last item is ranked (history before it); the figure
            reported is the test split's at the epoch of the best validation HR@10 (their checkpoint
            monitors recall@10), training stops --patience epochs after it (theirs: 200 epochs, patience 50).
  metric    each user's last item, after all items before it, against every item of the catalog, the items
            in the user's history left out (a held-out item the user had already is a miss); ties placed as a
            random order would (shardflow.model.metrics.rank_gains, the engine's own rule).

It prints, per dataset, min / median / max over the seeds beside the anchors, with the epochs chosen, seconds per
epoch and the load. bench/model_quality.py prints the engine's figures on the same split for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sequence_logs import parse_logs  # bench/ is on sys.path: this runs as a script beside it
from torch import nn

from shardflow.model.metrics import rank_gains

FORMATS = ("s3rec", "sasrec")  # one user per line, or one "user item" pair per line
ANCHORS = {"beauty": (0.0921, 0.0531, "SASRec+SS, eSASRec benchmark README")}  # HR@10, NDCG@10
BLOCKS, HEADS, DROPOUT, HISTORY, NEGATIVES = 1, 1, 0.2, 50, 256
BATCH, LR, BETAS = 128, 1e-3, (0.9, 0.98)
SCORED_AT_A_TIME = 1024  # users whose catalog scores are held at once


def sequences(path: Path, fmt: str) -> list[list[int]]:
    """Each user's items in time order, the items numbered 1 to N in the order of their ids (the bundled logs
    number them so already; another log's catalog is then its N distinct items, as the engine's is)."""
    users: dict[str, list[str]] = {}
    for line in path.open():
        if fmt == "s3rec":
            user, *items = line.split()
            users.setdefault(user, []).extend(items)
        elif line.strip():
            user, item = line.split()
            users.setdefault(user, []).append(item)
    distinct = sorted({i for items in users.values() for i in items},
                      key=lambda i: (0, int(i), "") if i.isdigit() else (1, 0, i))
    number = {item: k for k, item in enumerate(distinct, start=1)}
    return [[number[i] for i in items] for items in users.values() if items]


def windows(histories: list[list[int]]) -> torch.Tensor:
    """[users, HISTORY] the last HISTORY items of each, left-padded with 0."""
    out = torch.zeros(len(histories), HISTORY, dtype=torch.long)
    for i, h in enumerate(histories):
        h = h[-HISTORY:]
        if h:
            out[i, -len(h):] = torch.tensor(h)
    return out


class SASRec(nn.Module):
    def __init__(self, items: int, dim: int, item_dropout: bool):
        super().__init__()
        self.item_dropout = item_dropout
        self.item = nn.Embedding(items + 1, dim, padding_idx=0)
        self.position = nn.Embedding(HISTORY, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm_q": nn.LayerNorm(dim), "attention": nn.MultiheadAttention(dim, HEADS, DROPOUT, batch_first=True),
            "norm_ff": nn.LayerNorm(dim), "ff1": nn.Linear(dim, dim), "ff2": nn.Linear(dim, dim)})
            for _ in range(BLOCKS))
        self.drop = nn.Dropout(DROPOUT)
        self.last = nn.LayerNorm(dim, eps=1e-8)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
        self.register_buffer("causal", ~torch.ones(HISTORY, HISTORY, dtype=torch.bool).tril())

    def rows(self) -> torch.Tensor:
        """[items + 1, dim] the catalog's rows as a training step reads them: with item_dropout, units dropped
        out, one mask per row for the step's history and candidates alike."""
        return self.drop(self.item.weight) if self.item_dropout else self.item.weight

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[users, HISTORY, dim] the state after every position of the windows x, their items read from rows."""
        keep = (x != 0)[..., None].float()
        e = self.drop(rows[x] + self.position.weight)
        for b in self.blocks:
            e = e * keep
            q = b["norm_q"](e)
            e = q + b["attention"](q, e, e, attn_mask=self.causal, need_weights=False)[0]
            f = b["norm_ff"](e)
            e = f + self.drop(b["ff2"](self.drop(torch.relu(b["ff1"](f)))))
        return self.last(e * keep)


def ranked(model: SASRec, histories: list[list[int]], targets: torch.Tensor) -> dict[str, float]:
    """HR@10, NDCG@10, HR@20, NDCG@20 of each target among every item, each user's history left out."""
    model.eval()
    sums = dict.fromkeys(("hr_at_10", "ndcg_at_10", "hr_at_20", "ndcg_at_20"), 0.0)
    with torch.no_grad():
        for s in range(0, len(histories), SCORED_AT_A_TIME):
            part = histories[s : s + SCORED_AT_A_TIME]
            score = model(windows(part), model.item.weight)[:, -1] @ model.item.weight.T
            target = targets[s : s + len(part)]
            own = score.gather(1, target[:, None])
            rows = torch.tensor([i for i, h in enumerate(part) for _ in h], dtype=torch.long)
            seen = torch.tensor([j for h in part for j in h], dtype=torch.long)
            missed = torch.zeros(len(part), dtype=torch.bool)
            missed[rows[seen == target[rows]]] = True
            counted = torch.ones_like(score, dtype=torch.bool)
            counted[:, 0] = False  # the padding row
            counted[rows, seen] = False
            counted[torch.arange(len(part)), target] = False
            above = ((score > own) & counted).sum(1).numpy()
            tied = ((score == own) & counted).sum(1).numpy()
            for k in (10, 20):
                hit, gain = rank_gains(above, tied, k)
                sums[f"hr_at_{k}"] += float(np.where(missed.numpy(), 0.0, hit).sum())
                sums[f"ndcg_at_{k}"] += float(np.where(missed.numpy(), 0.0, gain).sum())
    model.train()
    return {k: v / len(histories) for k, v in sums.items()}


def run(users: list[list[int]], seed: int, epochs: int, patience: int, dim: int, item_dropout: bool) -> dict:
    """Train one seed; the test figures at the best validation epoch, the epoch, and seconds per epoch."""
    torch.manual_seed(seed)
    items = max(max(u) for u in users)
    train = [u[:-2][-(HISTORY + 1):] for u in users if len(u) >= 4]  # at least one target after one item
    x, y = windows([u[:-1] for u in train]), windows([u[1:] for u in train])
    val_users = [u for u in users if len(u) >= 3]
    val_in, val_target = [u[:-2] for u in val_users], torch.tensor([u[-2] for u in val_users])
    test_in, test_target = [u[:-1] for u in users], torch.tensor([u[-1] for u in users])
    model = SASRec(items, dim, item_dropout)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS)
    best, best_epoch, train_s = -1.0, 0, []
    for epoch in range(1, epochs + 1):
        t, losses = time.perf_counter(), []
        for batch in torch.randperm(len(train)).split(BATCH):
            target = y[batch]
            real = target != 0
            rows = model.rows()
            state, positive = model(x[batch], rows)[real], target[real]
            candidates = torch.cat([positive[:, None], torch.randint(1, items + 1, (positive.numel(), NEGATIVES))], 1)
            logit = torch.bmm(rows[candidates], state[:, :, None])[..., 0]
            loss = F.cross_entropy(logit, torch.zeros(positive.numel(), dtype=torch.long))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        train_s.append(time.perf_counter() - t)
        val = ranked(model, val_in, val_target)["hr_at_10"]
        if val > best:
            best, best_epoch, test = val, epoch, ranked(model, test_in, test_target)
        print(f"    epoch {epoch:3d}: loss {statistics.fmean(losses):.4f}  validation HR@10 {val:.4f}  "
              f"(best: epoch {best_epoch}, test HR@10 {test['hr_at_10']:.4f} NDCG@10 {test['ndcg_at_10']:.4f}; "
              f"{train_s[-1]:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
        if epoch - best_epoch >= patience:
            break
    return {**test, "epoch": best_epoch, "train_s": statistics.median(train_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="beauty,games",
                        help="beauty, games, or FORMAT:PATH of another log (FORMAT: s3rec or sasrec)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--patience", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64, help="64 as the README's table; 256 as its loo configs")
    parser.add_argument("--item-dropout", action="store_true",
                        help="drop out the item rows each step, as RecTools 0.13 (the benchmark's pin) does")
    args = parser.parse_args()
    logs = parse_logs(args.datasets, ["beauty", "games"], FORMATS)
    for flag in ("epochs", "patience", "threads", "dim"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} {getattr(args, flag)}; accepted: an integer >= 1")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds {args.seeds}; accepted: comma-separated integers") from None
    torch.set_num_threads(args.threads)
    print(f"load before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.threads} threads; dim {args.dim}; "
          f"seeds {seeds}; up to {args.epochs} epochs, patience {args.patience}; item dropout {args.item_dropout}",
          flush=True)
    results = {}
    for name, log in logs.items():
        users = sequences(*log)
        print(f"{name}: {len(users):,} users, {max(max(u) for u in users):,} items", flush=True)
        for seed in seeds:
            print(f"  seed {seed}", flush=True)
            t = time.perf_counter()
            figures = run(users, seed, args.epochs, args.patience, args.dim, args.item_dropout)
            results.setdefault(name, []).append({**figures, "wall_s": time.perf_counter() - t})
    print(f"\nload after: {os.getloadavg()[0]:.1f}")
    print("the whole catalog, seen items excluded; test figures at the best validation epoch")
    fmt3 = lambda v: f"{v[0]:.4f}/{statistics.median(v):.4f}/{v[-1]:.4f}"  # noqa: E731
    print(f"{'dataset':8} {'epochs':>11} {'HR@10 min/median/max':>22} {'NDCG@10 min/median/max':>24} "
          f"{'HR@20 median':>12} {'NDCG@20':>8} {'anchor HR@10':>12} {'NDCG@10':>8} {'ratios':>11} "
          f"{'s/epoch':>7} {'minutes':>7}  anchor")
    for name, runs in results.items():
        spread = {k: sorted(r[k] for r in runs) for k in ("hr_at_10", "ndcg_at_10", "hr_at_20", "ndcg_at_20")}
        hr, ndcg, where = ANCHORS.get(name, (None, None, "none known"))
        anchor = (f"{hr:12.4f} {ndcg:8.4f} {statistics.median(spread['hr_at_10']) / hr:5.2f} "
                  f"{statistics.median(spread['ndcg_at_10']) / ndcg:5.2f}") if hr else f"{'':12} {'':8} {'':11}"
        print(f"{name:8} {'/'.join(str(r['epoch']) for r in runs):>11} {fmt3(spread['hr_at_10']):>22} "
              f"{fmt3(spread['ndcg_at_10']):>24} {statistics.median(spread['hr_at_20']):12.4f} "
              f"{statistics.median(spread['ndcg_at_20']):8.4f} {anchor} "
              f"{statistics.median(r['train_s'] for r in runs):7.1f} "
              f"{statistics.median(r['wall_s'] for r in runs) / 60:7.1f}  {where}")


if __name__ == "__main__":
    main()

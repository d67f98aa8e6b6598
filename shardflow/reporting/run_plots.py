"""The run directory's plots (RUN_DIR/plots, SVG): the access curve with its tier boundaries, each strategy's
traffic per device, and the loss and AUC of every epoch with a complete checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardflow.planner.report import PlanSummary, StrategyRefused
from shardflow.planner.sharding_plan import GLOBAL, NODE
from shardflow.reporting.plots import bar_chart, line_chart, stacked_chart
from shardflow.sharding.stage import read_plan
from storage.checkpoint import CheckpointManifest, epoch_records
from storage.profile import Profile


def run_plots(run_dir: str | Path, profile_path: str | Path, plan_path: str | Path,
              strategies: list[PlanSummary | StrategyRefused]) -> list[Path]:
    """Write the plots of a run's profile, plan and the strategies compared; their paths."""
    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plan = read_plan(plan_path).plan
    prof = Profile.open(profile_path)
    curves: dict[str, tuple[list[float], list[float]]] = {}
    marks: dict[str, float] = {}
    for t in plan.tables:
        counts = np.sort(prof.counts(t.name))[::-1]
        ranks = np.unique(np.geomspace(1, counts.size, 400).astype(np.int64))
        curves[t.name] = (ranks.tolist(), np.maximum(counts[ranks - 1], 1).tolist())
        n_global, n_node = int((t.tier == GLOBAL).sum()), int((t.tier == NODE).sum())
        if n_global:
            marks[f"{t.name}: global | node"] = n_global
        if n_node:
            marks[f"{t.name}: node | single"] = n_global + n_node
    files = [line_chart(out / "access.svg", curves, title="Accesses per row, most-read first (tiers dashed)",
                        xlabel="row rank", ylabel="accesses", log=True, marks=marks)]
    groups = {r.strategy: [b / 1e6 for b in r.device_bytes_per_step] for r in strategies if isinstance(r, PlanSummary)}
    files.append(bar_chart(out / "traffic.svg", groups, title="Bytes sent + received per device per step (cost model)",
                           xlabel="device", ylabel="MB per step"))
    epochs = [m for _, m in epoch_records(run_dir)]
    if epochs:
        panels = [("training loss", {"training loss": _per_epoch(epochs, "loss")}),
                  ("held-out AUC", {"AUC (held out)": _per_epoch(epochs, "auc")})]
        ranked = _per_epoch(epochs, "val_full_ndcg_at_10")  # the validation split among the whole catalog
        if ranked[0]:
            panels.append(("full NDCG@10", {"NDCG@10 (validation, whole catalog)": ranked}))
        files.append(stacked_chart(out / "training.svg", panels, title="Loss and quality per epoch",
                                   xlabel="epochs done", integer_x=True))
    return files


def _per_epoch(manifests: list[CheckpointManifest], figure: str) -> tuple[list[float], list[float]]:
    """(epochs done, `figure`) of the checkpoints that recorded it."""
    points = [(float(m.epochs_done), float(v)) for m in manifests if (v := getattr(m, figure)) is not None]
    return [x for x, _ in points], [y for _, y in points]

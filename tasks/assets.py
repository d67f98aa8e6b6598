"""Each model version as a Prefect asset, and the events that say which one serves.

A version's export is the asset `shardflow://<run_dir label>/versions/NNNN/model` (the label of run names and
artifact keys: the run_dir's name and six hex digits of its path; an asset key may hold no space, `%` or `#`,
which a path may). Its upstream assets are the dataset parts the version trained on, its profile and the
plan that trained. It is materialized once the version is judged, so that its metadata carries the held-out
figures and the verdict; the download that wrote it is the task before.

`shardflow.model.promoted`, `shardflow.model.rejected` and `shardflow.model.rolled-back` are emitted with
the run_dir as their resource and the version's asset as a related one; emitted inside a flow run, Prefect
relates them to the run and its deployment too (what automations match).
"""

from __future__ import annotations

import re
from pathlib import Path

from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NONE

from shardflow.reporting.run_report import run_label
from shardflow.reporting.summary import RunSummary
from storage import versions

SCHEME = "shardflow://"
# Figures a version's asset carries when the version has them.
FIGURES = ("auc", "logloss", "hr_at_10", "ndcg_at_10", "full_hr_at_10", "full_ndcg_at_10", "previous_auc")


def run_resource(run: str | Path) -> dict[str, str]:
    """The run_dir as an event's resource."""
    return {"prefect.resource.id": f"shardflow.run-dir.{run_label(run)}",
            "prefect.resource.name": str(Path(run).resolve())}


def asset_key(run: str | Path, *names: str) -> str:
    """The asset key of a path under a run_dir, each name slugged to the characters a key allows."""
    label = run_label(run)
    return SCHEME + "/".join([label, *(re.sub(r"[^A-Za-z0-9._-]+", "-", n).strip("-") or "-" for n in names)])


def model_key(run: str | Path, number: int) -> str:
    return asset_key(run, "versions", f"{number:04d}", "model")


def upstream(run: str | Path, number: int) -> list[Asset]:
    """The parts version `number` trained on (its window), its profile and the plan that trained it."""
    began = versions.began(run, number)
    names = began.parts or tuple(f"part-{k + 1}" for k in range(len(began.segments)))
    parts = [Asset(key=asset_key(run, "dataset", "parts", name),
                   properties=AssetProperties(name=f"part {name}", description=f"a part of {Path(run).resolve()}/"
                                              f"dataset, imported from {name}"))
             for name in names[began.window[0]:]]
    return [*parts, Asset(key=asset_key(run, "versions", f"{number:04d}", "profile")),
            Asset(key=asset_key(run, "versions", f"{number:04d}", "plan"))]


def materialize_model(run: str, summary: RunSummary) -> str:
    """Materialize the version of `summary` (a judged, trained version) as an asset with its upstream assets
    and its figures as metadata (a task run named `model-asset-vN`); its key."""
    number = summary.version
    model = Asset(key=model_key(run, number), properties=AssetProperties(
        name=f"{run_label(run)} v{number}",
        description=f"Model version {number} of run_dir {Path(run).resolve()}: its exported tables and dense "
                    f"layers ({versions.version_dir(run, number).resolve() / 'model'})"))
    metadata = {
        "version": number,
        "verdict": "promoted" if summary.promoted else "rejected",
        "warm_start_from": summary.warm_start_from,
        "plan": "made" if summary.plan.replanned else "kept",
        "epochs": summary.training.epochs,
        "held_out_users": summary.eval_users,
        "full_ranking": summary.held_out.full_ranking,
        **{k: v for k, v in summary.to_dict().items() if k in FIGURES and v is not None},
    }

    def record(key: str, values: dict) -> str:
        add_asset_metadata(key, values)
        return key

    task = materialize(model, asset_deps=upstream(run, number), name="model-asset",
                       task_run_name=f"model-asset-v{number}", cache_policy=NONE)(record)
    return task(model.key, metadata)


def emit_model_event(kind: str, run: str | Path, number: int, payload: dict) -> None:
    """`shardflow.model.<kind>` (promoted, rejected, rolled-back) about version `number` of `run`."""
    from prefect.events import emit_event

    emit_event(event=f"shardflow.model.{kind}", resource=run_resource(run),
               related=[{"prefect.resource.id": model_key(run, number), "prefect.resource.role": "asset"}],
               payload={"version": number, **payload})

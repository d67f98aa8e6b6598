"""What an operator reads of a retraining run in the Prefect UI, published: the run's name and tags, its
summary, the versions, promotions and epoch-metrics tables and the quality plot (built by
shardflow.reporting).
"""

from __future__ import annotations

import base64
from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from shardflow.config import RetrainConfig
from shardflow.reporting.run_report import (
    artifact_key,
    failure_markdown,
    quality_svg,
    run_label,
    summary_markdown,
    version_rows,
)
from shardflow.reporting.summary import RunSummary
from shardflow.reporting.tables import epoch_rows
from storage import versions


def name_run(run_dir: str | Path, what: str) -> None:
    """Rename this flow run to `<run_dir label>·<what>` (e.g. `nightly-3f2a1c·v3`), once its version is known."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=f"{run_label(run_dir)}·{what}")


def tag_run(tags: list[str]) -> None:
    """Add `tags` to this flow run's (what the runs list filters by)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        known = set(client.read_flow_run(flow_run.id).tags)
        client.update_flow_run(flow_run.id, tags=sorted(known | set(tags)))


def publish_failure(run_dir: str, error: BaseException) -> None:
    """The failed night's summary; a run_dir too damaged to read for it gets the failure alone."""
    try:
        text = failure_markdown(run_dir, error)
    except Exception as unreadable:  # noqa: BLE001 (the run's own error is the one to report)
        text = f"# Retraining run `{run_dir}`: **failed**\n\n- what failed: {type(error).__name__}: {error}\n" \
               f"- the run_dir could not be read for more ({type(unreadable).__name__}: {unreadable})"
    create_markdown_artifact(text, key=artifact_key("retrain-summary", run_dir),
                             description="Retraining run summary (failed)")


def publish_versions(run: str) -> list[dict]:
    """The versions table of a run_dir and the quality plot beside it (the history the UI keeps)."""
    rows = version_rows(run)
    create_table_artifact(rows, key=artifact_key("versions", run),
                          description=f"Model versions of {run}: start (UTC date), held-out metrics over `users` "
                                      "held-out users (full_ndcg_at_10: the whole catalog, seen items excluded) beside "
                                      "the model each replaced (same events), state, plan")
    by_hand = [{"at": p.at[:16].replace("T", " "), "version": p.version, "was": p.previous, "by": p.by,
                "why": p.reason if len(p.reason) <= 60 else p.reason[:57] + "..."}  # whole in promotions.json
               for p in versions.promotions(run)]
    if by_hand:
        create_table_artifact(by_hand, key=artifact_key("promotions", run),
                              description=f"Versions of {run} made current by an operator (shardflow promote, the "
                                          "rollback deployment): when (UTC), which, the one it replaced, who, why")
    svg = quality_svg(rows)
    if svg is not None:
        picture = base64.b64encode(svg.encode()).decode()
        create_markdown_artifact(
            f"# Quality by version: `{run}`\n\nHeld-out AUC of each new version and of the model it replaced, "
            f"measured on the same held-out events of that night.\n\n![quality](data:image/svg+xml;base64,{picture})",
            key=artifact_key("quality", run), description="Held-out AUC by version, new vs replaced")
    return rows


def announce_rollback(run: str, record: versions.Promotion) -> None:
    """After an operator's promotion: the shardflow.model.rolled-back event and the versions and promotions
    tables published again, so the UI shows the version that now serves and who made it current, and why."""
    from tasks.assets import emit_model_event

    emit_model_event("rolled-back", run, record.version,
                     {"previous": record.previous, "by": record.by, "at": record.at, "reason": record.reason})
    publish_versions(run)


def publish_summary(s: RunSummary, config: RetrainConfig) -> None:
    create_markdown_artifact(summary_markdown(s, config), key=artifact_key("retrain-summary", s.run_dir),
                             description="Retraining run summary")


def publish_epoch_metrics(version_dir: str, run_dir: str, modeled_bytes_per_step: float) -> None:
    """The epoch-metrics table of a model version (shardflow.reporting.tables.epoch_rows), under one key per
    run_dir, so the UI keeps its history night after night."""
    create_table_artifact(
        epoch_rows(version_dir, modeled_bytes_per_step),
        key=artifact_key("epoch-metrics", run_dir),
        description=f"Per epoch: loss, held-out metrics (val_: on the validation split), speed, traffic measured "
                    f"and its ratio to the plan's model ({modeled_bytes_per_step / 1e6:,.3f} MB/step) ({version_dir})",
    )

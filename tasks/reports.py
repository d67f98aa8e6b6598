"""What an operator reads of a retraining run in the Prefect UI: the run's name and state message,
its summary, the versions table and the quality of every version beside the model it replaced.

Tables keep short values in every column (the UI cuts a table at about 1600 px and takes
its columns from the first row); long reasons go into markdown artifacts of their own.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from shardflow.config import RetrainConfig
from shardflow.reporting.summary import RunSummary
from shardflow.reporting.tables import number
from storage import versions
from storage.checkpoint import complete_checkpoints
from tasks.retrain import artifact_key, run_label
from tasks.versions import version_result


def name_run(run_dir: str | Path, what: str) -> None:
    """Rename this flow run to `<run_dir label>·<what>` (e.g. `nightly-3f2a1c·v3`), once its version is known."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=f"{run_label(run_dir)}·{what}")


SHORT_LABELS = {"auc": "AUC", "full_ndcg_at_10": "full NDCG@10"}  # the state message's names of LABELS' figures


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _figure(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def outcome(s: RunSummary) -> str:
    """The name of the run's final state (a COMPLETED type): what the night did, readable in the runs list."""
    if not s.trained:
        return "No new data"
    return "Promoted" if s.promoted else "Rejected"


def state_message(s: RunSummary) -> str:
    """One short line for the flow run's final state, the verdict first (under 70 characters, as the UI shows a
    state's message in full); the summary artifact has the held-out events and the reasons."""
    if not s.trained:
        return f"no new data since v{s.newest_version}: v{s.current} stays current (AUC {s.auc:.4f})"
    on = s.promoted_on or "auc"  # a version made before the gate's figure was named was gated on AUC
    label, mine, theirs = SHORT_LABELS[on], getattr(s, on), getattr(s, f"previous_{on}")
    if theirs is None:
        return f"promoted v{s.version} (cold start): {label} {mine:.4f}"
    if s.promoted:
        return f"promoted v{s.version}: {label} {mine:.4f} vs v{s.warm_start_from}'s {theirs:.4f}"
    return f"rejected v{s.version}: {label} {mine:.4f} < v{s.warm_start_from}'s {theirs:.4f}; v{s.current} stays"


def tag_run(tags: list[str]) -> None:
    """Add `tags` to this flow run's (what the runs list filters by)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        known = set(client.read_flow_run(flow_run.id).tags)
        client.update_flow_run(flow_run.id, tags=sorted(known | set(tags)))


def next_run(run_dir: str | Path) -> str:
    """What the next run of `run_dir` does with what a failed run left."""
    made = versions.numbers(run_dir)
    last = made[-1] if made else None
    if last is None or versions.result(run_dir, last) is not None:
        return "tries again from the stores as they are (nothing of this run is kept)"
    done = complete_checkpoints(versions.version_dir(run_dir, last))
    if done:
        return (f"resumes version {last} from its checkpoint after epoch {done[-1][0]} (same data and "
                "configuration; on a new plan if only the topology changed)")
    return f"starts version {last} again from the beginning (no checkpoint of it was complete)"


def failure_markdown(run_dir: str, error: BaseException) -> str:
    current = versions.current(run_dir)
    held = version_result(run_dir, current) if current else None
    stays = (
        "no version is current yet" if held is None
        else f"version **{current}** stays current ({held.metrics().text()})"
    )
    line = " ".join(str(error).split()) or type(error).__name__
    return "\n".join([
        f"# Retraining run `{run_dir}`: **failed**",
        "",
        f"- what failed: {type(error).__name__}: {line}",
        f"- {stays}",
        f"- the next run {next_run(run_dir)}",
    ])


def publish_failure(run_dir: str, error: BaseException) -> None:
    """The failed night's summary; a run_dir too damaged to read for it gets the failure alone."""
    try:
        text = failure_markdown(run_dir, error)
    except Exception as unreadable:  # noqa: BLE001 (the run's own error is the one to report)
        text = f"# Retraining run `{run_dir}`: **failed**\n\n- what failed: {type(error).__name__}: {error}\n" \
               f"- the run_dir could not be read for more ({type(unreadable).__name__}: {unreadable})"
    create_markdown_artifact(text, key=artifact_key("retrain-summary", run_dir),
                             description="Retraining run summary (failed)")


def version_rows(run: str) -> list[dict]:
    """One row per version; every row has every column, metrics with four decimals, short values: the table fits
    the UI's artifact width (about 1,000 px at 1,600). `replaced_auc`: the model that was current when the version
    was made, on the same held-out events (the gate's comparison; the summary has the rest); `users`: how many
    held-out users the figures are over. Who made a version current by hand: the promotions table."""
    rows, current = [], versions.current(run)
    results = {n: version_result(run, n) for n in versions.numbers(run)}
    metric = "logloss" if any(r is not None and r.logloss is not None for r in results.values()) else "hr_at_10"
    # The whole catalog's NDCG@10 where any version ranked it (full_ranking on): no column that is always empty.
    full = metric != "logloss" and any(r is not None and r.full_ndcg_at_10 is not None for r in results.values())
    for n, r in results.items():
        began = versions.started(run, n)
        done = {} if r is None else r.to_dict()  # an unfinished version: every figure empty
        replanned = done.get("replanned")
        rows.append(
            {
                "version": n,
                "started": began.started[5:10],  # MM-DD (UTC): the night; its time and year are in its summary
                "from": began.warm_start_from,
                "auc": _figure(done.get("auc")),
                "replaced_auc": _figure(done.get("previous_auc")),
                metric: _figure(done.get(metric)),
                **({} if metric == "logloss" else {"ndcg_at_10": _figure(done.get("ndcg_at_10"))}),
                **({"full_ndcg_at_10": _figure(done.get("full_ndcg_at_10"))} if full else {}),
                "epochs": None if r is None else _epochs_kept(r),
                "users": number(done.get("eval_users"), 0),
                "state": "unfinished"
                if r is None
                else "current"
                if n == current
                else "promoted"
                if r.promoted
                else "rejected",
                "plan": None
                if replanned is None
                else "kept"
                if not replanned
                else "made"
                if began.warm_start_from is None
                else "re-made",
            }
        )
    return rows


def _epochs_kept(result: RunSummary) -> str:
    """'7 of 10' (the best validation epoch kept, of the epochs trained), '10' without a validation split."""
    return str(result.epochs) if result.best_epoch is None else f"{result.best_epoch} of {result.epochs}"


def quality_svg(rows: list[dict]) -> str | None:
    """Held-out AUC per version beside the model it replaced on the same events (None before one finished)."""
    from shardflow.reporting.plots import stacked_chart

    done = [r for r in rows if r["auc"]]
    if not done:
        return None
    series = {"new version": ([r["version"] for r in done], [float(r["auc"]) for r in done])}
    before = [r for r in done if r["replaced_auc"]]
    if before:
        series["replaced model"] = ([r["version"] for r in before], [float(r["replaced_auc"]) for r in before])
    with tempfile.TemporaryDirectory() as tmp:
        path = stacked_chart(Path(tmp) / "quality.svg", [("held-out AUC", series)],
                             title="Held-out AUC by version (same events for new and replaced)", xlabel="version",
                             integer_x=True)
        return path.read_text()


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


def _kept_epoch(s: RunSummary) -> list[str]:
    """The line on the epoch chosen on the validation split, when one was held out."""
    if s.best_epoch is None:
        return []
    return [f"- epoch **{s.best_epoch}** of {s.epochs} kept: the best on the validation split "
            f"({s.metrics('val_').text()}; patience {s.patience} epochs)"]


def summary_markdown(s: RunSummary, config: RetrainConfig) -> str:
    mb, us = 1e6, "µs"
    held_out = "the held-out last rows" if s.logloss is not None else "leave-last-out"
    auc = f"**{s.metrics().text()}** ({held_out} of the version's newest parts, exported model)"
    if not s.trained:
        head = [f"- **no new data**: nothing trained; version **{s.current}** stays current",
                f"- version {s.version}: {auc}"]
    else:
        start = f"warm start from version {s.warm_start_from}" if s.warm_start_from else "cold start"
        verdict = "**promoted** (now current)" if s.promoted else f"**{s.message}**"  # it begins "version N not …"
        previous = "" if s.previous_auc is None else \
            f"; version {s.warm_start_from} on the same held-out events: AUC {s.previous_auc:.4f}"
        old = s.previous_plan_comm_time_us_per_step
        plan = "kept" if not s.replanned else "made" if not s.warm_start_from else "re-made"
        head = [
            f"- version **{s.version}** ({start}), parts {s.window[0] + 1}..{s.parts} trained, "
            f"{len(s.parts_added)} part(s) imported by this run: {verdict}",
            f"- {auc}{previous}",
            f"- plan **{plan}**: {s.replan_reason.removeprefix(plan + ' ')}" + ("" if us in s.replan_reason else
            f" (fresh plan {s.fresh_plan_comm_time_us_per_step:.1f} {us}"
            + ("" if old is None else f", kept plan {old:.1f} {us}") + " per step, modeled)"),
        ]
    lines = [
        f"# Retraining run `{s.run_dir}`",
        "",
        f"- strategy **{config.plan.strategy}** on `{config.plan.topology}`, {_count(s.epochs, 'epoch')}, "
        f"batch {config.train.batch_size}",
        *head,
        *_kept_epoch(s),
        # Like for like: measured against the trained plan's model; that model against row-wise-mod's.
        (f"- traffic **{s.bytes_per_step / mb:.3f} MB/step measured** (the last epochs trained) against "
         if s.bytes_per_step is not None else "- traffic not measured (no checkpoint recorded it); ")
        + f"{s.modeled_bytes_per_step / mb:.3f} MB/step that the cost model predicts for the plan that trained",
        f"- modeled communication time per step: **{s.comm_time_us_per_step:.1f} {us}** "
        f"with {config.plan.strategy}, "
        f"{s.row_wise_comm_time_us_per_step:.1f} {us} with row-wise-mod "
        f"({s.row_wise_comm_time_us_per_step / max(s.comm_time_us_per_step, 1e-12):.2f}× its time); "
        f"{s.row_wise_bytes_per_step / mb:.3f} MB/step with row-wise-mod",
        f"- loss per epoch (this run): {', '.join(f'{x:.4f}' for x in s.epoch_loss) or 'none'}",
        f"- exported model: `{s.model}`",
        *([f"- top-{config.nightly.top_k} lists of the users seen ({config.nightly.recommend_users}), Parquet: "
           f"`{s.recommendations}`"] if s.recommendations else []),
        *([f"- Dask performance report (task stream, workers' profiles, bandwidth; open it in a browser): "
           f"`{s.dask_report}`"] if s.dask_report else []),
        f"- resumed from: `{s.resumed_from}`" if s.resumed_from else "- resumed from no checkpoint",
        *(f"- **skipped damaged checkpoint** `{k['checkpoint']}`: {k['reason']}" for k in s.skipped_checkpoints),
        f"- worker losses recovered from a checkpoint: {s.restarts} (max_restarts {config.train.max_restarts})",
        *(f"- **warning**: {w}" for w in s.warnings),
        "- checkpoints: " + (", ".join(f"`{c}`" for c in s.checkpoints) or "none"),
        "- versions, checkpoints, models and plots (SVG files) on the machine that ran it: `" + s.run_dir + "`",
        *_stage_table(s.stage_seconds),
        "",
        # Embedded, not linked: a path on the worker host is no picture in a browser elsewhere.
        *(f"![{Path(p).stem}](data:image/svg+xml;base64,{base64.b64encode(Path(p).read_bytes()).decode()})"
          for p in s.plots if Path(p).is_file()),
    ]
    return "\n".join(lines)


def _stage_table(stages: dict | None) -> list[str]:
    """Where the run's wall time went, a row a stage in the order they ran (they add up to the run)."""
    if not stages:
        return []
    total = sum(stages.values())
    return ["", f"Where the run's {total:,.1f} s went:", "", "| stage | s | share |", "|---|---:|---:|",
            *(f"| {name} | {v:,.1f} | {v / max(total, 1e-9):.0%} |" for name, v in stages.items())]


def publish_summary(s: RunSummary, config: RetrainConfig) -> None:
    create_markdown_artifact(summary_markdown(s, config), key=artifact_key("retrain-summary", s.run_dir),
                             description="Retraining run summary")

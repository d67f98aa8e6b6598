"""What an operator reads of a retraining run, built from its stores without Prefect: the run's state name
and message, its summary and failure markdown, the versions table's rows and the quality plot, and the keys
and labels runs of one run_dir share (tasks/reports.py publishes them).

Tables keep short values in every column (the UI cuts a table at about 1600 px and takes
its columns from the first row); long reasons go into markdown artifacts of their own.
"""

from __future__ import annotations

import base64
import hashlib
import re
import tempfile
from pathlib import Path
from typing import Any

from shardflow.config import RetrainConfig
from shardflow.reporting.summary import RunSummary
from shardflow.reporting.tables import number
from storage import versions
from storage.checkpoint import complete_checkpoints


def artifact_key(kind: str, run_dir: str | Path) -> str:
    """A Prefect artifact key of one kind for one run_dir: runs of other run_dirs keep their own history.

    Keys allow lowercase letters, digits and dashes: the run_dir's name, slugged, and six
    hex digits of its absolute path (two run_dirs of one name stay apart).
    """
    resolved = Path(run_dir).expanduser().resolve()
    slug = re.sub(r"[^a-z0-9]+", "-", resolved.name.lower()).strip("-")[:40] or "run"
    return f"{kind}-{slug}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:6]}"


def run_label(run_dir: str | Path) -> str:
    """The run_dir as flow run names and asset keys show it: its name and the six hex digits of its path (as
    artifact keys)."""
    return artifact_key("", run_dir).lstrip("-")


def version_result(run: str, number: int) -> RunSummary | None:
    """Version `number`'s result.json, parsed (None: the version is not finished)."""
    figures = versions.result(run, number)
    where = str(versions.version_dir(run, number) / versions.RESULT)
    return None if figures is None else RunSummary.parse(figures, where)


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
        return f"no new data since v{s.newest_version}: v{s.current} stays current (AUC {s.held_out.auc:.4f})"
    on = s.promoted_on or "auc"  # a version made before the gate's figure was named was gated on AUC
    label, mine, theirs = SHORT_LABELS[on], getattr(s.held_out, on), getattr(s.previous, on)
    if theirs is None:
        return f"promoted v{s.version} (cold start): {label} {mine:.4f}"
    if s.promoted:
        return f"promoted v{s.version}: {label} {mine:.4f} vs v{s.warm_start_from}'s {theirs:.4f}"
    return f"rejected v{s.version}: {label} {mine:.4f} < v{s.warm_start_from}'s {theirs:.4f}; v{s.current} stays"


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
        else f"version **{current}** stays current ({held.held_out.text()})"
    )
    line = " ".join(str(error).split()) or type(error).__name__
    return "\n".join([
        f"# Retraining run `{run_dir}`: **failed**",
        "",
        f"- what failed: {type(error).__name__}: {line}",
        f"- {stays}",
        f"- the next run {next_run(run_dir)}",
    ])


def version_rows(run: str) -> list[dict[str, Any]]:
    """One row per version; every row has every column, metrics with four decimals, short values: the table fits
    the UI's artifact width (about 1,000 px at 1,600). `replaced_auc`: the model that was current when the version
    was made, on the same held-out events (the gate's comparison; the summary has the rest); `users`: how many
    held-out users the figures are over. Who made a version current by hand: the promotions table."""
    rows, current = [], versions.current(run)
    results = {n: version_result(run, n) for n in versions.numbers(run)}
    measured = [r.held_out for r in results.values() if r is not None]
    metric = "logloss" if any(m.logloss is not None for m in measured) else "hr_at_10"
    # The whole catalog's NDCG@10 where any version ranked it (full_ranking on): no column that is always empty.
    full = metric != "logloss" and any(m.full_ndcg_at_10 is not None for m in measured)
    for n, r in results.items():
        began = versions.started(run, n)
        if began is None:  # removed since it was listed
            continue
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
    t = result.training
    return str(t.epochs) if t.best_epoch is None else f"{t.best_epoch} of {t.epochs}"


def quality_svg(rows: list[dict[str, Any]]) -> str | None:
    """Held-out AUC per version beside the model it replaced on the same events, and the whole catalog's NDCG@10
    where ranked (None before one finished)."""
    from shardflow.reporting.plots import stacked_chart

    done = [r for r in rows if r["auc"]]
    if not done:
        return None
    series = {"new version": ([r["version"] for r in done], [float(r["auc"]) for r in done])}
    before = [r for r in done if r["replaced_auc"]]
    if before:
        series["replaced model"] = ([r["version"] for r in before], [float(r["replaced_auc"]) for r in before])
    panels = [("held-out AUC", series)]
    ranked = [r for r in done if r.get("full_ndcg_at_10")]  # a sequence model ranked among the whole catalog
    if ranked:
        panels.append(("full NDCG@10", {"new version": ([r["version"] for r in ranked],
                                                        [float(r["full_ndcg_at_10"]) for r in ranked])}))
    with tempfile.TemporaryDirectory() as tmp:
        path = stacked_chart(Path(tmp) / "quality.svg", panels,
                             title="Held-out quality by version (same events for new and replaced)", xlabel="version",
                             integer_x=True)
        return path.read_text()


def _kept_epoch(s: RunSummary) -> list[str]:
    """The line on the epoch chosen on the validation split, when one was held out."""
    if s.training.best_epoch is None:
        return []
    return [f"- epoch **{s.training.best_epoch}** of {s.training.epochs} kept: the best on the validation split "
            f"({s.validation.text()}; patience {s.training.patience} epochs)"]


def summary_markdown(s: RunSummary, config: RetrainConfig) -> str:
    mb, us = 1e6, "µs"
    held_out = "the held-out last rows" if s.held_out.logloss is not None else "leave-last-out"
    auc = f"**{s.held_out.text()}** ({held_out} of the version's newest parts, exported model)"
    if not s.trained:
        head = [f"- **no new data**: nothing trained; version **{s.current}** stays current",
                f"- version {s.version}: {auc}"]
    else:
        start = f"warm start from version {s.warm_start_from}" if s.warm_start_from else "cold start"
        verdict = "**promoted** (now current)" if s.promoted else f"**{s.message}**"  # it begins "version N not …"
        previous = "" if s.previous.auc is None else \
            f"; version {s.warm_start_from} on the same held-out events: AUC {s.previous.auc:.4f}"
        p = s.plan
        old = p.previous_plan_comm_time_us_per_step
        plan = "kept" if not p.replanned else "made" if not s.warm_start_from else "re-made"
        head = [
            f"- version **{s.version}** ({start}), parts {s.window[0] + 1}..{s.parts} trained, "
            f"{len(s.parts_added)} part(s) imported by this run: {verdict}",
            f"- {auc}{previous}",
            f"- plan **{plan}**: {p.replan_reason.removeprefix(plan + ' ')}" + ("" if us in p.replan_reason else
            f" (fresh plan {p.fresh_plan_comm_time_us_per_step:.1f} {us}"
            + ("" if old is None else f", kept plan {old:.1f} {us}") + " per step, modeled)"),
        ]
    lines = [
        f"# Retraining run `{s.run_dir}`",
        "",
        f"- strategy **{config.plan.strategy}** on `{config.plan.topology}`, {_count(s.training.epochs, 'epoch')}, "
        f"batch {config.train.batch_size}",
        *head,
        *_kept_epoch(s),
        # Like for like: measured against the trained plan's model; that model against row-wise-mod's.
        (f"- traffic **{s.training.bytes_per_step / mb:.3f} MB/step measured** (the last epochs trained) against "
         if s.training.bytes_per_step is not None else "- traffic not measured (no checkpoint recorded it); ")
        + f"{s.plan.modeled_bytes_per_step / mb:.3f} MB/step that the cost model predicts for the plan that trained",
        f"- modeled communication time per step: **{s.plan.comm_time_us_per_step:.1f} {us}** "
        f"with {config.plan.strategy}, "
        f"{s.plan.row_wise_comm_time_us_per_step:.1f} {us} with row-wise-mod "
        f"({s.plan.row_wise_comm_time_us_per_step / max(s.plan.comm_time_us_per_step, 1e-12):.2f}× its time); "
        f"{s.plan.row_wise_bytes_per_step / mb:.3f} MB/step with row-wise-mod",
        f"- loss per epoch (this run): {', '.join(f'{x:.4f}' for x in s.training.epoch_loss) or 'none'}",
        f"- exported model: `{s.training.model}`",
        *([f"- top-{config.nightly.top_k} lists of the users seen ({config.nightly.recommend_users}), Parquet: "
           f"`{s.recommendations}`"] if s.recommendations else []),
        *([f"- Dask performance report (task stream, workers' profiles, bandwidth; open it in a browser): "
           f"`{s.dask_report}`"] if s.dask_report else []),
        f"- resumed from: `{s.training.resumed_from}`" if s.training.resumed_from else "- resumed from no checkpoint",
        *(f"- **skipped damaged checkpoint** `{k['checkpoint']}`: {k['reason']}"
          for k in s.training.skipped_checkpoints),
        f"- worker losses recovered from a checkpoint: {s.training.restarts} "
        f"(max_restarts {config.train.max_restarts})",
        *(f"- **warning**: {w}" for w in s.warnings),
        "- checkpoints: " + (", ".join(f"`{c}`" for c in s.training.checkpoints) or "none"),
        "- versions, checkpoints, models and plots (SVG files) on the machine that ran it: `" + s.run_dir + "`",
        *_stage_table(s.stage_seconds),
        "",
        # Embedded, not linked: a path on the worker host is no picture in a browser elsewhere.
        *(f"![{Path(p).stem}](data:image/svg+xml;base64,{base64.b64encode(Path(p).read_bytes()).decode()})"
          for p in s.plots if Path(p).is_file()),
    ]
    return "\n".join(lines)


def _stage_table(stages: dict[str, float] | None) -> list[str]:
    """Where the run's wall time went, a row a stage in the order they ran (they add up to the run)."""
    if not stages:
        return []
    total = sum(stages.values())
    return ["", f"Where the run's {total:,.1f} s went:", "", "| stage | s | share |", "|---|---:|---:|",
            *(f"| {name} | {v:,.1f} | {v / max(total, 1e-9):.0%} |" for name, v in stages.items())]

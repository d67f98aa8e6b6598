"""The run's table artifacts, one builder per stage, in one number format: text with thousands separators and a
fixed number of decimals per unit (the Prefect UI shows a table's numbers as given: 2k, 4880 and 5328.0 in one
column before). Every row has every column (the UI takes its columns from the first row), short ones: a table
fits the UI's artifact width (about 1,000 px at 1,600)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardflow.planner.report import PlanSummary, StrategyRefused
from shardflow.training.validation import VALIDATION_KEYS
from storage.checkpoint import epoch_records
from storage.profile import TableStats

MB = 1e6


def number(value: float | None, decimals: int) -> str:
    """`value` with thousands separators and `decimals` decimals; "" for None (a figure not measured)."""
    return "" if value is None else f"{value:,.{decimals}f}"


def profile_rows(stats: dict[str, TableStats]) -> list[dict[str, Any]]:
    """The profile table: each table's rows, accesses, rows read and skew."""
    return [{"table": name, "rows": number(s.rows, 0), "accesses": number(s.accesses, 0),
             "rows_read": number(s.distinct, 0), "top_1pct_share": number(s.top1pct_share, 3),
             "top_10pct_share": number(s.top10pct_share, 3), "zipf_slope": number(s.zipf_slope, 2)}
            for name, s in stats.items()]


def profile_description(dataset: str, first: int, history: int | None) -> str:
    window = "" if history is None else \
        f", as the training examples of parts {first + 1}.. read it (histories of up to {history} items)"
    return (f"Row access skew of {dataset}{window} (top_1pct_share / top_10pct_share: the share of all accesses "
            "that reads the most-read 1% / 10% of the rows read)")


def comparison_rows(rows: list[PlanSummary | StrategyRefused], chosen: str, replanned: bool,
                    kept: PlanSummary | None) -> list[dict[str, Any]]:
    """The plan-comparison table: every strategy's figures, `trains` marking the plan the version trains on —
    the chosen strategy's fresh plan, or the previous version's plan, extended (`kept`, a row of its own with
    its own figures, not the fresh plan's)."""
    table = [_comparison_row(r, trains=r.strategy == chosen and replanned) for r in rows]
    if kept is not None:
        table.append(_comparison_row(kept, trains=True, plan="kept"))
    return table


def _comparison_row(r: PlanSummary | StrategyRefused, trains: bool = False, plan: str = "made") -> dict[str, Any]:
    if isinstance(r, StrategyRefused):  # says so in `plan`, its reason in plan-refusals
        return {"strategy": r.strategy, "plan": "none: see plan-refusals", "trains": "",
                **dict.fromkeys(("MB_per_step", "inter_node_MB", "comm_us", "bound_us", "max_MB_per_device"), "")}
    return {
        "strategy": r.strategy,
        "plan": plan,
        "trains": "yes" if trains else "",
        "MB_per_step": number(r.bytes_per_step / MB, 3),
        "inter_node_MB": number(r.inter_node_bytes_per_step / MB, 3),
        "comm_us": number(r.comm_time_s_per_step * 1e6, 1),
        "bound_us": number(r.lower_bound_comm_time_s_per_step * 1e6, 1),
        "max_MB_per_device": number(max(r.memory_bytes_per_device) / MB, 3),
    }


def refusals_markdown(rows: list[PlanSummary | StrategyRefused]) -> str | None:
    """Why each strategy that made no plan made none (long reasons: a table would cut them off); None if all
    made one."""
    refused = [r for r in rows if isinstance(r, StrategyRefused)]
    if not refused:
        return None
    return "\n".join(["# Strategies that made no plan", ""]
                     + [f"- **{r.strategy}**: {r.error.removeprefix(f'{r.strategy}: ')}" for r in refused])


def epoch_rows(version_dir: str | Path, modeled_bytes_per_step: float) -> list[dict[str, Any]]:
    """The epoch-metrics table of a model version: one row per epoch a checkpoint records (complete or retired),
    so it spans resumed runs.

    A metric no epoch has (log-loss of a sequence model, val_ without a split) is left out;
    traffic is the measured MB per step and its ratio to the plan's model (none for a plan
    with nothing to send: one device).
    """
    figures = [(epoch, m.figures) for epoch, m in epoch_records(version_dir)]
    metrics = [k for k in ("auc", "hr_at_10", "ndcg_at_10", "logloss", *VALIDATION_KEYS)
               if any(f[k] is not None for _, f in figures)]
    rows = []
    for epoch, info in figures:
        measured = info["bytes_per_step"]
        rows.append({"epoch": epoch, "loss": number(info["loss"], 4), **{k: number(info[k], 4) for k in metrics},
                     "examples/s": number(info["examples_per_s"], 0), "seconds": number(info["seconds"], 1),
                     "MB/step": number(None if measured is None else measured / MB, 3),
                     "measured/modeled": number(None if measured is None or not modeled_bytes_per_step
                                                else measured / modeled_bytes_per_step, 3)})
    return rows

"""A retraining run's summary as one typed value: what the flow returns, result.json stores (less the run's own
keys), `shardflow run --json` prints and the UI's summary reads.

Its keys and their types are declared here once; `parse` checks a dict read back from JSON (a
result.json of an earlier version, the flow's result) against them and names the first bad key
(shardflow.records). A key a version made before it existed lacks is taken as None where None is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardflow.model.metrics import Metrics
from shardflow.records import parse_record, record_of

# The run's, not the version's: not in result.json (the lists are written after it, from the current model).
RUN_KEYS = ("current", "message", "newest_version", "recommendations", "stage_seconds", "dask_report")


@dataclass(frozen=True, kw_only=True)
class VersionFigures:
    """What a trained version measured, as the flow hands it to the promotion gate (tasks.versions.gate), which
    adds the replaced model's metrics on the same held-out items and its decision: the RunSummary."""

    run_dir: str
    version: int
    trained: bool
    warm_start_from: int | None
    parts_added: tuple[str, ...]
    parts: int
    window: tuple[int, ...]  # (first part trained on, first part evaluated on), counted from 0
    epochs: int
    best_epoch: int | None = None  # the epoch kept on the validation split (None: no split)
    patience: int | None = None
    auc: float
    hr_at_10: float | None = None  # sequences
    ndcg_at_10: float | None = None
    logloss: float | None = None  # click logs
    val_auc: float | None = None
    val_hr_at_10: float | None = None
    val_ndcg_at_10: float | None = None
    val_logloss: float | None = None
    # the held-out item among every item (sequences; None: not ranked, or a version made before it was)
    full_ranking: str | None = None  # what was ranked: exclude-seen or include-seen (shardflow.model.ranking)
    full_hr_at_10: float | None = None
    full_ndcg_at_10: float | None = None
    full_hr_at_20: float | None = None
    full_ndcg_at_20: float | None = None
    eval_users: int
    bytes_per_step: float | None  # measured (None: no checkpoint recorded it)
    modeled_bytes_per_step: float
    row_wise_bytes_per_step: float
    comm_time_us_per_step: float
    row_wise_comm_time_us_per_step: float
    replanned: bool
    replan_reason: str
    fresh_plan_comm_time_us_per_step: float
    previous_plan_comm_time_us_per_step: float | None
    checkpoints: tuple[str, ...]
    model: str
    downloads: int
    epoch_loss: tuple[float, ...]
    resumed_from: str | None
    skipped_checkpoints: tuple[dict[str, str], ...]  # {"checkpoint": path, "reason": why}
    restarts: int
    warnings: tuple[str, ...]
    plots: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class RunSummary(VersionFigures):
    previous_auc: float | None = None  # the version it warm-started from, on the same held-out items
    previous_hr_at_10: float | None = None
    previous_ndcg_at_10: float | None = None
    previous_logloss: float | None = None
    previous_full_ranking: str | None = None
    previous_full_hr_at_10: float | None = None
    previous_full_ndcg_at_10: float | None = None
    previous_full_hr_at_20: float | None = None
    previous_full_ndcg_at_20: float | None = None
    promoted: bool
    promoted_on: str | None = None  # the figure the gate compared (shardflow.promotion; None: before it was named)
    finished: str  # UTC, ISO 8601
    current: int | None = None  # the run's: the current version after it
    message: str | None = None  # why a version was not promoted, or what a run that trained nothing found
    newest_version: int | None = None  # a run that trained nothing: the last version made
    recommendations: str | None = None  # the store of the users' top-K lists this run wrote (nightly.top_k)
    stage_seconds: dict[str, float] | None = None  # stage -> seconds of its wall time (shardflow.reporting.stages)
    dask_report: str | None = None  # the HTML performance report of the version's work on the cluster

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: tuples as lists; newest_version only where a run trained nothing, recommendations,
        stage_seconds and dask_report only where it wrote or timed them."""
        out = record_of(self)
        for key in ("newest_version", "recommendations", "stage_seconds", "dask_report"):
            if out[key] is None:
                del out[key]
        return out

    def stored(self) -> dict[str, Any]:
        """What the version's result.json keeps: the summary less the run's own keys."""
        return {k: v for k, v in self.to_dict().items() if k not in RUN_KEYS}

    def metrics(self, prefix: str = "") -> Metrics:
        """The held-out metrics (prefix "val_": the validation split's, "previous_": the replaced model's)."""
        return Metrics.read(record_of(self), prefix)

    @classmethod
    def parse(cls, values: dict[str, Any], where: str = "a run summary") -> RunSummary:
        """The summary in `values`; an InputError naming the first key that is missing or of the wrong type."""
        return parse_record(cls, values, where)

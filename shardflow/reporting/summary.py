"""A retraining run's summary as one typed value: what the flow returns, result.json stores (less the run's own
keys), `shardflow run --json` prints and the UI's summary reads.

Its keys and their types are declared here once; `parse` checks a dict read back from JSON (a
result.json of an earlier version, the flow's result) against them and names the first bad key
(shardflow.records). A key a version made before it existed lacks is taken as None where None is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardflow.errors import InputError
from shardflow.model.metrics import FULL_FIGURES, FULL_METRICS, METRICS, Metrics
from shardflow.records import parse_fields, parse_record, record_of

# The run's, not the version's: not in result.json (the lists are written after it, from the current model).
RUN_KEYS = ("current", "message", "newest_version", "recommendations", "stage_seconds", "dask_report")


@dataclass(frozen=True, kw_only=True)
class TrainingFigures:
    """How a version trained: its epochs and the one kept, the traffic it measured, what it wrote and resumed."""

    epochs: int
    best_epoch: int | None = None  # the epoch kept on the validation split (None: no split)
    patience: int | None = None
    epoch_loss: tuple[float, ...]  # this run's epochs
    bytes_per_step: float | None  # measured (None: no checkpoint recorded it)
    checkpoints: tuple[str, ...]
    model: str
    downloads: int
    resumed_from: str | None
    skipped_checkpoints: tuple[dict[str, str], ...]  # {"checkpoint": path, "reason": why}
    restarts: int


@dataclass(frozen=True, kw_only=True)
class PlanFigures:
    """The plan that trained, modeled beside row-wise-mod's, and why it was kept or made (a ReplanDecision)."""

    modeled_bytes_per_step: float
    row_wise_bytes_per_step: float
    comm_time_us_per_step: float
    row_wise_comm_time_us_per_step: float
    replanned: bool
    replan_reason: str
    fresh_plan_comm_time_us_per_step: float
    previous_plan_comm_time_us_per_step: float | None


@dataclass(frozen=True, kw_only=True)
class VersionFigures:
    """What a trained version measured, as the flow hands it to the promotion gate (tasks.versions.gate), which
    adds the replaced model's metrics on the same held-out items and its decision: the RunSummary.

    In JSON every field of its parts is a top-level key (`held_out`'s under their metric names, `validation`'s
    with val_), as result.json has always held them."""

    run_dir: str
    version: int
    trained: bool
    warm_start_from: int | None
    parts_added: tuple[str, ...]
    parts: int
    window: tuple[int, ...]  # (first part trained on, first part evaluated on), counted from 0
    held_out: Metrics  # on the newest parts' held-out items; full_*: among every item (sequences, when ranked)
    validation: Metrics = Metrics(None)  # on the validation split, at the epoch kept (none without a split)
    eval_users: int
    training: TrainingFigures
    plan: PlanFigures
    warnings: tuple[str, ...]
    plots: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class RunSummary(VersionFigures):
    previous: Metrics = Metrics(None)  # the version it warm-started from, on the same held-out items
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
        """The JSON form, flat: tuples as lists; newest_version only where a run trained nothing, recommendations,
        stage_seconds and dask_report only where it wrote or timed them."""
        out = record_of(self)
        for part in ("training", "plan"):
            out.update(out.pop(part))
        out.pop("eval_users")
        out.update({**self.held_out.values(full=True), **self.validation.values(VAL),
                    **{VAL + k: getattr(self.validation, k) for k in FULL_FIGURES}, "eval_users": self.eval_users,
                    **self.previous.values(PREVIOUS, full=True)})
        for key in ("held_out", "validation", "previous"):
            del out[key]
        for key in ("newest_version", "recommendations", "stage_seconds", "dask_report"):
            if out[key] is None:
                del out[key]
        return out

    def stored(self) -> dict[str, Any]:
        """What the version's result.json keeps: the summary less the run's own keys."""
        return {k: v for k, v in self.to_dict().items() if k not in RUN_KEYS}

    @classmethod
    def parse(cls, values: dict[str, Any], where: str = "a run summary") -> RunSummary:
        """The summary in `values` (flat, as to_dict writes it); an InputError naming the first key that is
        missing or of the wrong type. Metrics a version made before they existed lacks are None."""
        own = parse_fields(cls, values, where, skip=PARTS)
        held_out = parse_record(Metrics, values, where)
        if held_out.auc is None:
            raise InputError(f"{where}: auc = None; accepted: int or float")
        return cls(**own, held_out=held_out, validation=_metrics(values, VAL, where),  # type: ignore[arg-type]
                   previous=_metrics(values, PREVIOUS, where), training=parse_record(TrainingFigures, values, where),
                   plan=parse_record(PlanFigures, values, where))


VAL, PREVIOUS = "val_", "previous_"
PARTS = ("held_out", "validation", "previous", "training", "plan")  # parsed as themselves from the flat keys


def _metrics(values: dict[str, Any], prefix: str, where: str) -> Metrics:
    """The metrics under `prefix` keys, each checked; a key a summary lacks is None."""
    keys = (*METRICS, *FULL_METRICS)
    return parse_record(Metrics, {prefix + k: values.get(prefix + k) for k in keys}, where, prefix)

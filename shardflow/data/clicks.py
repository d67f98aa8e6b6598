"""Click logs as their trainers read them, and the choice between the two workloads.

A click-log dataset (imported from Criteo's, Avazu's or RecBole's layout) has no item
sequence: every row is one example, with one id per categorical table (up to the table's
width of a table of token sequences, such as genres), its numeric columns and a 0/1
label, and the store keeps the rows in arrival order. The last HELD_OUT of the rows
(by that order) are held out for evaluation, the rows before them are the training
targets; with a validation split, the last HELD_OUT of those are held out to choose
epochs on. With a window (a model version trained on the newest parts), training starts
at the window's first part and the held-out rows are the last HELD_OUT of the parts
evaluated on.

The epoch's order, its split into sub-batches and the block cache work as for sequences
(shardflow.data.batches); what differs is an example and how it is scored.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.data.batches import ORDER_BLOCK_EVENTS, EpochOrder, Lookups, TrainData, fetched, window_start
from shardflow.errors import InputError
from shardflow.model import sizes
from shardflow.model.configs import ClickConfig, ClickIndex, ModelConfig, numeric_input
from shardflow.model.metrics import ScoredRows
from storage.checkpoint import ExportManifest
from storage.dataset import Dataset

HELD_OUT = 0.1  # the share of the rows (the last ones) held out for evaluation


@dataclass(frozen=True)
class Clicks:
    ids: dict[str, np.ndarray]  # table -> int64 [E], or [E, width] for a table of token sequences (-1 padding)
    numeric: np.ndarray  # float32 [E, numeric columns], as stored (NaN = missing)
    labels: np.ndarray  # float32 [E]

    def __len__(self) -> int:
        return len(self.labels)


class ClickData(EpochOrder):
    item = None  # no item sequence
    scored = ScoredRows  # what its scored held-out rows add up to

    def __init__(self, ds: Dataset, features: tuple[str, ...], window: tuple[int, int],
                 block_events: int = ORDER_BLOCK_EVENTS, validation: bool = False) -> None:
        self.dataset, self.features, self.window, self.block_events = ds, tuple(features), window, block_events
        self.validation = validation
        self.numeric = tuple(ds.info.dense)
        self.rows = {t: ds.info.table(t).rows for t in self.features}
        # The shape of one example's ids of each table: () for one id, (width,) for a table of token sequences.
        self.id_shape = {t: (ds.info.widths[t],) if t in ds.info.widths else () for t in self.features}
        self.events = ds.info.interactions
        part_starts = np.concatenate([[0], np.cumsum([s.events for s in ds.segments])]).astype(np.int64)
        first_train, first_eval = (int(part_starts[min(w, len(ds.segments))]) for w in window)
        self.eval_start = self.events - math.ceil(HELD_OUT * (self.events - first_eval))
        self.validation_start = self.eval_start
        if validation:
            self.validation_start -= math.ceil(HELD_OUT * max(self.eval_start - first_train, 0))
        self.train_range = (first_train, self.validation_start)
        self.blocks = -(-self.events // block_events)
        starts = np.arange(self.blocks, dtype=np.int64) * block_events
        lo = np.maximum(starts, first_train)
        hi = np.minimum(starts + block_events, self.validation_start)
        self.targets_per_block = np.maximum(hi - lo, 0)
        self.targets = int(self.targets_per_block.sum())
        self._cache = OrderedDict()  # (block, part) -> its HeldPart

    @classmethod
    def load(cls, ds: Dataset, features: tuple[str, ...], window: tuple[int, int],
             block_events: int = ORDER_BLOCK_EVENTS, validation: bool = False) -> ClickData:
        if not ds.info.labels:
            raise InputError(
                f"dataset {ds.path} has neither an item sequence nor click labels (tables "
                f"{', '.join(ds.info.table_names)}); accepted: a dataset imported from sasrec, s3rec or recbole "
                "(sequences) or from criteo (click logs)"
            )
        unknown = [f for f in features if f not in ds.info.table_names]
        if unknown or not features:
            raise InputError(f"categorical tables {list(features)}; accepted: some of {', '.join(ds.info.table_names)}")
        data = cls(ds, features, window, block_events, validation)
        if data.targets == 0:
            held = "validation and test rows" if validation else f"last {HELD_OUT:.0%}"
            raise InputError(f"dataset {ds.path}: no training rows before the held-out {held} "
                             f"(window from part {window[0] + 1})")
        return data

    @property
    def offset_users(self) -> int:
        """Users whose offsets a trainer holds: none (a click row is its own example)."""
        return 0

    @property
    def eval_targets(self) -> np.ndarray:
        return np.arange(self.eval_start, self.events, dtype=np.int64)

    @property
    def validation_targets(self) -> np.ndarray:
        """The last HELD_OUT of the training window's rows before the test rows; only with a validation split."""
        self._check_validation()
        return np.arange(self.validation_start, self.eval_start, dtype=np.int64)

    def block_targets(self, block: int) -> np.ndarray:
        start = block * self.block_events
        lo, hi = max(start, self.train_range[0]), min(start + self.block_events, self.train_range[1])
        return np.arange(lo, max(lo, hi), dtype=np.int64)

    # -- examples ----------------------------------------------------------------------------
    @property
    def columns(self) -> tuple[str, ...]:
        return (*(f"tables/{t}" for t in self.features), *(f"dense/{n}" for n in self.numeric), "labels")

    def _column(self, path: str, start: int, stop: int) -> np.ndarray:
        return self.dataset.stored_column(path, start, stop)  # rows as they arrived: no per-row user offsets held

    def examples(self, targets: np.ndarray, config: ClickConfig, seed: int = 0, negatives: int | None = None,
                 step: int | None = None) -> Clicks:
        """The click rows `targets` (`seed`, `negatives` and `step` as the sequence log's take them: a click log
        draws no negatives and drops nothing)."""
        targets = np.asarray(targets, dtype=np.int64)
        ids = {t: np.empty((targets.size, *self.id_shape[t]), dtype=np.int64) for t in config.features}
        numeric = np.empty((targets.size, len(self.numeric)), dtype=np.float32)
        labels = np.empty(targets.size, dtype=np.float32)
        for block, part, sel in self._parts_of(targets):  # each part's rows found once, for every column
            part_held = self._part(block, part, 0)
            at, held = part_held.at(targets[sel], targets[sel]), part_held.columns
            for t in config.features:
                ids[t][sel] = held[t][at]
            for k, n in enumerate(self.numeric):
                numeric[sel, k] = held[f"dense/{n}"][at]
            labels[sel] = held["labels"][at]
        return Clicks(ids=ids, numeric=numeric, labels=labels)

    def lookups(self, ex: Clicks, config: ClickConfig, dedup: str) -> Lookups:
        """Which rows a trainer needs for `ex`; with scope `none` each occurrence is fetched on its own. A table
        of token sequences fetches the ids its examples hold; its padding (-1) stays -1 in the index."""
        fetch, where = {}, {}
        for name in config.features:
            ids = ex.ids[name]
            if ids.ndim == 1:
                fetch[name], where[name] = fetched(ids, dedup, self.rows[name])
                continue
            held = ids >= 0
            fetch[name], at = fetched(ids[held], dedup, self.rows[name])
            where[name] = np.full(ids.shape, -1, dtype=np.int64)
            where[name][held] = at
        return Lookups(fetch=fetch, index=ClickIndex(where, numeric_input(ex.numeric), ex.labels))

    def table_index(self, ex: Clicks, config: ClickConfig) -> ClickIndex:
        """Where each lookup finds its row in whole tables (row = id): the reference trainer's index."""
        return ClickIndex({t: ex.ids[t] for t in config.features}, numeric_input(ex.numeric), ex.labels)

    # -- evaluation: the held-out rows ---------------------------------------------------------
    def eval_examples(self, targets: np.ndarray, config: ClickConfig, seed: int, negatives: int) -> Clicks:
        return self.examples(targets, config)


def load_training_data(dataset: str | Path | Dataset, features: tuple[str, ...] = (), window: tuple[int, int] = (0, 0),
                       block_events: int = ORDER_BLOCK_EVENTS, validation: bool = False) -> TrainData | ClickData:
    """The dataset's training data: its item sequences if it has them, else its click rows; `validation`
    holds a validation split out of training as well."""
    ds = dataset if isinstance(dataset, Dataset) else Dataset.open(dataset)
    if ds.info.sequence_table is None:
        return ClickData.load(ds, features, window, block_events, validation)
    return TrainData.load(ds, features, window, block_events, validation)


def training_window_start(dataset: Dataset, wanted: int, batch_size: int, eval_from: int,
                          validation: bool = False) -> int:
    """`wanted`, or the latest earlier part whose window holds at least one global batch of training
    examples (0 if none does): window_start for sequences; for click logs, the rows of the parts from
    there on before the held-out last rows of the parts from `eval_from`."""
    if dataset.info.sequence_table is not None:
        return window_start(dataset, wanted, batch_size, validation)
    fits = [s for s in range(wanted + 1)
            if ClickData(dataset, (), (s, eval_from), validation=validation).targets >= batch_size]
    return fits[-1] if fits else 0


def model_config(dataset: Dataset, *, dim: int, mlp: tuple[int, ...], bottom: tuple[int, ...], history: int,
                 negatives: int, seed: int, encoder: dict[str, Any] | None = None) -> ModelConfig | ClickConfig:
    """The model a dataset trains: the sequence model (every table other than the item sequence a
    feature; `encoder`: its encoder, blocks, heads and dropout) or, for a click log, the DLRM over all
    its tables and numeric columns. An encoder key given as none is the workload's (sizes.WORKLOAD_DEFAULTS: the
    CLI's flags leave them none); a key not given, the model's own default."""
    workload = sizes.WORKLOAD_DEFAULTS["clicks" if dataset.info.sequence_table is None else "sequences"]
    encoder = {k: workload.get(k) if v is None else v for k, v in (encoder or {}).items()}
    encoder = {k: v for k, v in encoder.items() if v is not None}
    if dataset.info.sequence_table is None:
        if encoder.get("encoder", "mean") != "mean":
            raise InputError(f"encoder = {encoder['encoder']!r} for the click log {dataset.path}; accepted: mean "
                             "(the encoder is the sequence model's)")
        if encoder.get("loss", "bce") != "bce":
            raise InputError(f"loss = {encoder['loss']!r} for the click log {dataset.path}; accepted: bce (a click "
                             "is a label of its own example)")
        return ClickConfig(dim=dim, bottom=tuple(bottom), mlp=tuple(mlp), features=tuple(dataset.info.table_names),
                           numeric=tuple(dataset.info.dense), seed=seed)
    return ModelConfig(dim=dim, mlp=tuple(mlp), history=history, negatives=negatives,
                       features=dataset.info.feature_tables, seed=seed, **encoder)


def config_record(config: ModelConfig | ClickConfig) -> dict[str, Any]:
    """The model's config as an export's manifest keeps it."""
    return {"kind": config.kind, **asdict(config)}


# Keys an earlier shardflow wrote into model records that no model takes now: training settings (no parameter of the
# exported model depends on them), left out when a record is read.
RETIRED_KEYS = ("candidate_dropout",)


def read_record(record: dict[str, Any]) -> dict[str, Any]:
    """A kept config record as config_record makes it: lists as tuples, the kind (records written
    before click logs trained hold sequence models without one), a key the record predates at
    its default (the model it describes was made with it), and no retired key."""
    kind = record.get("kind", "sequence")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()
              if k != "kind" and k not in RETIRED_KEYS}
    defaults = {f.name: f.default for f in fields(ClickConfig if kind == "click" else ModelConfig)
                if f.default is not MISSING}
    return {"kind": kind, **defaults, **values}


# A model record's keys that shape no parameter and no optimiser slot.
TRAINING_SETTINGS = ("seed", "dropout", "item_dropout", "loss", "gbce_t")


def warm_start_record(config: ModelConfig | ClickConfig, dense_optimizer: str, row_optimizer: str) -> dict[str, Any]:
    """What a warm start carries over and must find unchanged: the model's record and the dense and row
    optimisers, whose slots (Adam's moments, Adagrad's sums) it carries too."""
    return {**config_record(config), "dense_optimizer": dense_optimizer, "row_optimizer": row_optimizer}


def exported_record(manifest: ExportManifest) -> dict[str, Any]:
    """warm_start_record of an exported model, from its manifest."""
    return {**read_record(manifest.model), "dense_optimizer": manifest.dense_optimizer,
            "row_optimizer": manifest.row_optimizer}


def shape_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The keys of warm_start_record `mine` whose value `theirs` does not share, where a warm start from
    `theirs` could not carry its parameters over: every key but the training settings, and none of the
    attention's (blocks, heads) between two mean encoders, which have no attention. The one rule for the
    flow's preflight and the engine's warm start."""
    both_mean = mine.get("encoder") == theirs.get("encoder") == "mean"
    ignored = {*TRAINING_SETTINGS, *(("blocks", "heads") if both_mean else ())}
    return sorted(k for k in mine if k not in ignored and theirs.get(k) != mine[k])


def config_from_record(record: dict[str, Any]) -> ModelConfig | ClickConfig:
    values = read_record(record)
    kind = values.pop("kind")
    return (ClickConfig if kind == "click" else ModelConfig)(**values)

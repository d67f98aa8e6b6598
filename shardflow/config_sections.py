"""The run config's sections, one per part of the run: data, model, plan, train, nightly and cluster
(shardflow.config.RetrainConfig holds them, with run_dir beside them).

Each section checks its own keys and what ties them; a check across sections is RetrainConfig's.
A key's name is unique across sections, so `sectioned` can put a bare key (`epochs`) or a dotted
one (`train.epochs`) into its section, and `overridden` lays `--set` over a config file's keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shardflow.errors import InputError
from shardflow.model import sizes
from shardflow.model.sizes import MAX_SEED, MAX_TOP_K

ROOT = Path(__file__).resolve().parents[1]
MAX_LOOKUPS = 4096  # history, negatives: rows one example reads, far past any published sequence model's
MAX_WIDTH = 65536  # an MLP layer's width
# Each epoch writes a checkpoint of every shard: 1,000 is five times the longest schedule of the published
# sequence-model benchmarks (200 epochs, patience 50: eSASRec, blondered/transformer_benchmark).
MAX_EPOCHS = 1000
MAX_COUNT = 2**31 - 1  # steps, users, batch sizes: int32 counters and numpy index arithmetic stay exact


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSection(Section):
    """What the run reads: the dataset and how its source files are imported."""

    dataset: str = Field(
        str(ROOT / "data" / "amazon-video" / "Video.txt"),
        description="a dataset store, or a source file imported into RUN_DIR/dataset with dataset_format",
    )
    dataset_format: Literal["sasrec", "s3rec", "recbole", "criteo"] = "sasrec"
    hash_rows: int | Literal["exact"] = Field(
        1 << 20, description="criteo: rows of each hashed categorical table, or exact (a row per distinct value); "
        "fixed by the first import",
    )
    click_label: str | None = Field(
        None, description="recbole: FIELD>=NUMBER ('rating>=4') makes the .inter file a click log (an interaction is "
        "a click when FIELD is at least NUMBER), joined with the .user and .item files beside it; fixed by the "
        "first import",
    )
    part_settle_s: float = Field(
        60.0, ge=0, le=7 * 86400, allow_inf_nan=False,
        description="a part of a dataset directory is read once it ends with a newline and has not been modified "
        "for this long (or, in a directory of NAME.done markers, once it has its marker); later parts wait with it",
    )

    @field_validator("dataset")
    @classmethod
    def _dataset_exists(cls, v: str) -> str:
        if not Path(v).exists():
            raise ValueError(f"{v}: no such file or directory; accepted: a dataset store or a source file")
        return v

    @field_validator("hash_rows")
    @classmethod
    def _hash_rows(cls, v: int | str) -> int | str:
        from storage.idmap import MAX_HASH_ROWS

        if v != "exact" and not 1 <= v <= MAX_HASH_ROWS:
            raise ValueError(f"{v!r}; accepted: an integer from 1 to {MAX_HASH_ROWS:,} (row ids are int32) or "
                             "'exact'")
        return v

    @field_validator("click_label")
    @classmethod
    def _click_label(cls, v: str | None) -> str | None:
        if v is not None:
            from storage.formats import parse_click_label

            try:
                parse_click_label(v)
            except InputError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _options_of_the_format(self) -> DataSection:
        default = type(self).model_fields["hash_rows"].default
        if self.hash_rows != default and self.dataset_format != "criteo":
            raise ValueError(f"hash_rows = {self.hash_rows} with dataset_format {self.dataset_format!r}; accepted: "
                             f"hash_rows only with dataset_format 'criteo' (hashed categorical columns)")
        if self.click_label is not None and self.dataset_format != "recbole":
            raise ValueError(f"click_label = {self.click_label!r} with dataset_format {self.dataset_format!r}; "
                             "accepted: click_label only with dataset_format 'recbole' (criteo logs carry labels)")
        return self


class ModelSection(Section):
    """The model's shape: embedding width, dense layers, the sequence encoder and what an example reads."""

    dim: int = Field(sizes.DIM, ge=1, le=4096)
    mlp: tuple[int, ...] = Field(sizes.MLP, description="hidden layer widths (of the top MLP for click logs)")
    bottom_mlp: tuple[int, ...] = Field(sizes.BOTTOM_MLP,
                                        description="click logs: hidden widths of the MLP over numeric columns")
    encoder: Literal["mean", "self-attention"] | None = Field(
        None, description="sequence datasets: the user's state from the history, its mean into the MLP, or "
        "SASRec's causal self-attention blocks scored by dot product (shardflow/model/attention.py); none: "
        "self-attention for a sequence log, mean for a click log (whose DLRM has no sequence encoder)",
    )
    attention_blocks: int = Field(sizes.RUN_BLOCKS, ge=1, le=64, description="self-attention: blocks")
    attention_heads: int = Field(sizes.HEADS, ge=1, le=MAX_WIDTH,
                                 description="self-attention: heads (a divisor of dim)")
    dropout: float = Field(sizes.RUN_DROPOUT, ge=0, lt=1, allow_inf_nan=False,
                           description="self-attention: dropout rate")
    item_dropout: float = Field(sizes.RUN_ITEM_DROPOUT, ge=0, lt=1, allow_inf_nan=False,
                                description="sequences: dropout rate on the item rows a training step reads, one "
                                "mask a row and step, the same for its history and candidate reads (RecTools "
                                "0.13's SASRec)")
    history: int = Field(sizes.RUN_HISTORY, ge=1, le=MAX_LOOKUPS,
                         description="items of a user's history an example reads")
    negatives: int = Field(sizes.RUN_NEGATIVES, ge=1, le=MAX_LOOKUPS, description="sampled negatives per example")
    loss: Literal["bce", "sampled-softmax", "gbce"] | None = Field(
        None, description="sequences: binary cross-entropy of every candidate (SASRec's), the positive's "
        "cross-entropy against a softmax over it and its negatives (sampled softmax), or gSASRec's generalised BCE "
        "(gbce: the positive's term weighted for the negatives' sampling rate, logits less log K); click logs: bce; "
        "none: gbce for a sequence log, bce for a click log",
    )
    gbce_t: float = Field(sizes.GBCE_T, ge=0, le=1, allow_inf_nan=False,
                          description="loss gbce: the calibration t (0: the positive's term unweighted; 1: fully "
                          "calibrated)")

    @field_validator("mlp", "bottom_mlp")
    @classmethod
    def _widths(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(w < 1 or w > MAX_WIDTH for w in v) or len(v) > 64:
            raise ValueError(f"widths {list(v)}; accepted: integers >= 1 and <= {MAX_WIDTH:,}, at most 64 of them")
        return v

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> ModelSection:
        if self.encoder == "self-attention" and self.dim % self.attention_heads:
            raise ValueError(f"attention_heads = {self.attention_heads} for dim {self.dim}; accepted: a divisor of dim")
        return self


class PlanSection(Section):
    """Sharding: the topology, the strategy, the per-device budget and the de-duplication scope it is priced by."""

    topology: str = Field(str(ROOT / "topologies" / "demo-4.yaml"), description="topology YAML file")
    strategy: Literal["table-wise", "row-wise-mod", "row-wise-block", "flexshard"] = "flexshard"
    memory_slack: float = Field(0.1, ge=0, le=100, allow_inf_nan=False,
                                description="per-device budget over row-wise-mod's bytes (0.1: 10% more)")
    dedup: Literal["none", "device", "node"] = "device"

    @field_validator("topology")
    @classmethod
    def _topology_exists(cls, v: str) -> str:
        if not Path(v).is_file():
            raise ValueError(f"{v}: no such file; accepted: a topology YAML file")
        return v


class TrainSection(Section):
    """The epochs: batch, optimisers, early stopping, where devices compute, evaluation and restarts."""

    epochs: int = Field(sizes.RUN_EPOCHS, ge=1, le=MAX_EPOCHS, description="epochs to train (with patience: at most)")
    patience: int | None = Field(
        sizes.RUN_PATIENCE, ge=1, le=MAX_EPOCHS,
        description="hold out each user's second-to-last item (a click log: the last 10% of the "
        "training rows) as a validation split, score it after every epoch (sequences: NDCG@10 among the whole "
        "catalog, among sampled items with full_ranking off; click logs: AUC), stop after this many epochs without "
        "a better score and keep the best epoch (none: no split, every epoch)",
    )
    min_epochs: int | None = Field(
        None, ge=1, le=MAX_EPOCHS, description="with patience: train at least this many epochs before stopping (rows "
        "trained with Adam may sit on a plateau for the first epochs)",
    )
    steps_per_epoch: int | None = Field(
        None, ge=1, le=MAX_COUNT,
        description="train only the first N steps of each epoch's order, a different sample of the log "
        "every epoch (none: the whole epoch): a night's budget on a log whose epoch outlasts it",
    )
    batch_size: int = Field(4096, ge=1, le=MAX_COUNT)
    dense_optimizer: Literal["adam", "adagrad"] = "adam"
    row_optimizer: Literal["adagrad", "adam"] | None = Field(
        None, description="the embedding rows' optimizer: row-wise Adagrad (one float of state a row) or "
        "Adam per row (2·dim + 1 floats a row: the plan's memory counts it); none: adam for a sequence log, "
        "adagrad for a click log",
    )
    row_lr: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="the rows' rate (none: 0.05 for adagrad, 0.002 for adam)")
    dense_lr: float = Field(1e-3, gt=0, allow_inf_nan=False)
    early_answers: bool = Field(
        False, description="answer the next step's row requests while waiting and patch them when it begins (scopes "
        "none and device): exact either way; pays only where a device waits on transfers with a core to spare",
    )
    transport: Literal["auto", "actor", "collective"] = Field(
        "auto", description="how a step's messages travel between devices: a gloo process group the devices form "
        "over their workers' host addresses (collective, torch.distributed; unencrypted, so not with the cluster's "
        "TLS files; not with early_answers), or Dask actor calls (actor); auto: collective unless the cluster has "
        "TLS files or early_answers is on; exact either way (docs/training.md: the transports)",
    )
    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = Field(0, ge=0, le=MAX_SEED, description="batch order and negatives (a 64-bit signed integer)")
    eval_users: int | None = Field(5000, ge=1, le=MAX_COUNT, description="held-out users evaluated (none: all)")
    full_ranking: Literal["exclude-seen", "include-seen", "off"] = Field(
        "exclude-seen", description="sequences: also rank each held-out item among the whole catalog (HR and NDCG "
        "at 10 and 20), leaving out the items its user had before (exclude-seen, as published full-ranking "
        "figures do) or not (include-seen), after training and, with patience, the validation split after every "
        "epoch, where the rows live; off: only the sampled protocol",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="times a run restores the cluster and the shards from the last checkpoint after losing a worker",
    )
    keep_checkpoints: int | None = Field(
        2, ge=1, le=MAX_EPOCHS,
        description="a version's newest N epoch checkpoints are kept and, with patience, its best-scoring one; an "
        "older one is retired once a newer one is complete: its shards (a copy of the model) deleted, its manifest "
        "kept as the epoch's record (none: every epoch's checkpoint kept)",
    )
    restart_timeout_s: float = Field(300.0, gt=0, le=86400, allow_inf_nan=False,
                                     description="how long a restore waits for enough workers")

    @model_validator(mode="after")
    def _transport_fits(self) -> TrainSection:
        from shardflow.training.config import check_transport

        try:
            check_transport(self.transport, self.early_answers)
        except InputError as e:
            raise ValueError(str(e)) from None
        return self

    @model_validator(mode="after")
    def _min_epochs_with_patience(self) -> TrainSection:
        from shardflow.training.validation import check_min_epochs

        try:
            check_min_epochs(self.min_epochs, self.patience, self.epochs)
        except InputError as e:
            raise ValueError(str(e)) from None
        return self


class NightlySection(Section):
    """Model versions: what a night trains on, when it re-plans, when it is promoted, what is kept."""

    train_window: str | int = Field(
        "new", description="what a new model version trains on: the parts added since the version it warm-starts "
        "from (new), the last N parts, or all of them; earlier events always serve as history",
    )
    replan_margin: float = Field(
        0.05, ge=0, lt=1, allow_inf_nan=False,
        description="re-plan when a fresh plan's predicted comm time beats the kept one's by more",
    )
    promotion_margin: float = Field(
        0.002, ge=0, le=1, allow_inf_nan=False,
        description="a new version is promoted unless its promote_on figure is below the current one's by more"
    )
    promote_on: Literal["auc", "full_ndcg_at_10"] = Field(
        "auc", description="the figure the promotion gate compares on the same held-out events: auc (both "
        "workloads), or full_ndcg_at_10 (sequences ranked among the whole catalog; needs full_ranking)",
    )
    top_k: int = Field(
        100, ge=0, le=MAX_TOP_K, description="after the gate, write each user's top-K items of the whole catalog "
        "from the current model, the items the user already had left out, as Parquet (RUN_DIR/versions/NNNN/"
        "recommendations; sequence models without event features); 0: none",
    )
    recommend_users: Literal["window", "all"] = Field(
        "window", description="whose lists a night writes: the users seen in the version's training window "
        "(window), or every user of the dataset (all)",
    )
    keep_versions: int = Field(3, ge=1, le=10000,
                               description="versions whose checkpoints are kept (the current one always)")

    @field_validator("train_window", mode="before")
    @classmethod
    def _window(cls, v: object) -> str | int:
        if v in ("new", "all") or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_COUNT):
            return v
        raise ValueError(f"{v!r}; accepted: 'new' (the parts since the warm-start source), 'all', or N >= 1 "
                         "(the last N parts)")


class ClusterSection(Section):
    """Where the Dask work runs: a local cluster (none set), an existing scheduler, or a cluster class."""

    scheduler_address: str | None = Field(None, description="an existing Dask scheduler (one worker per device)")
    cluster_class: str | None = Field(
        None, description="a Dask cluster class by import path: distributed.LocalCluster, dask_cuda.LocalCUDACluster, "
        "dask_kubernetes.operator.KubeCluster or a dask_jobqueue class (shardflow.cluster_options.CLUSTER_KWARGS)"
    )
    cluster_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="arguments of cluster_class: only the keys CLUSTER_KWARGS lists for it, "
        "each a plain value within its bound; nothing binds beyond loopback without the TLS files",
    )
    tls_ca_file: str | None = Field(None, description="TLS: the PEM file of the CA every party of the cluster trusts")
    tls_cert: str | None = Field(None, description="TLS: this cluster's PEM certificate (scheduler, workers, client)")
    tls_key: str | None = Field(None, description="TLS: the PEM private key of tls_cert")

    @field_validator("cluster_class", "scheduler_address")
    @classmethod
    def _cluster(cls, v: str | None, info: ValidationInfo) -> str | None:
        """Checked by shardflow.cluster before anything is imported or connected (the class is imported once its
        arguments are checked: _one_cluster)."""
        if v is not None:
            from shardflow.cluster import check_address, check_cluster_class

            try:
                (check_cluster_class if info.field_name == "cluster_class" else check_address)(v)
            except InputError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _one_cluster(self) -> ClusterSection:
        from shardflow.cluster import check_cluster_kwargs, resolve_cluster_class
        from shardflow.cluster_options import TlsFiles, check_tls_address

        if self.scheduler_address and self.cluster_class:
            raise ValueError("scheduler_address and cluster_class both set; accepted: at most one of them")
        try:
            tls = TlsFiles.parse(self.tls_ca_file, self.tls_cert, self.tls_key)
            check_tls_address(self.scheduler_address, tls)
            check_cluster_kwargs(self.cluster_class, self.cluster_kwargs, tls)  # before the class is imported
            if self.cluster_class:
                resolve_cluster_class(self.cluster_class)
        except InputError as e:
            raise ValueError(str(e)) from None
        return self


SECTIONS: dict[str, type[Section]] = {"data": DataSection, "model": ModelSection, "plan": PlanSection,
                                      "train": TrainSection, "nightly": NightlySection, "cluster": ClusterSection}
SECTION_OF = {key: name for name, section in SECTIONS.items() for key in section.model_fields}


def sectioned(values: dict) -> dict:
    """`values` with every bare key (`epochs`) and dotted key (`train.epochs`) moved into its section; a key given
    twice, or a dotted key naming no section, is refused. Unknown bare keys are left for the schema to refuse."""
    out: dict = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            pairs = [(key, k, f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(key, str) and "." in key:  # a YAML key may be a number, left for the schema to refuse
            section, _, name = key.partition(".")
            if section not in SECTIONS:
                raise ValueError(f"{key}: no section {section!r}; accepted: {', '.join(SECTIONS)}")
            pairs = [(section, name, key, value)]
        elif key in SECTION_OF:
            pairs = [(SECTION_OF[key], key, key, value)]
        else:
            out[key] = value
            continue
        for section, name, spelled, value in pairs:
            if (section, name) in given:
                raise ValueError(f"{spelled}: given twice (also as {given[section, name]}); accepted: one of them")
            given[section, name] = spelled
            out.setdefault(section, {})[name] = value
    return out


def overridden(values: dict, overrides: dict) -> dict:
    """`values` (a config file's) with `overrides` (`--set`'s) put over them key by key, either spelled any way."""
    out = {k: dict(v) if k in SECTIONS and isinstance(v, dict) else v for k, v in sectioned(values).items()}
    for key, value in sectioned(overrides).items():
        if key in SECTIONS and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key].update(value)
        else:
            out[key] = value
    return out


def workload(data: Any) -> str:
    """What the dataset trains, known before it is read: 'clicks' (the DLRM) for a criteo log, a recbole log with
    a click_label, or a store whose manifest names no sequence table; else 'sequences'. `data`: the data section,
    or its keys as given."""
    values = data.model_dump() if isinstance(data, Section) else data if isinstance(data, dict) else {}
    if values.get("dataset_format") == "criteo" or values.get("click_label") is not None:
        return "clicks"
    from storage.manifest import MANIFEST

    manifest = Path(str(values.get("dataset", DataSection.model_fields["dataset"].default))) / MANIFEST
    try:
        return "clicks" if json.loads(manifest.read_text())["sequence_table"] is None else "sequences"
    except (OSError, ValueError, KeyError, TypeError):  # a source to import, or a store its import will refuse
        return "sequences"


def with_workload_defaults(values: dict) -> dict:
    """Sectioned `values` with each key of sizes.WORKLOAD_DEFAULTS that is missing or none set to the workload's."""
    out = dict(values)
    for key, value in sizes.WORKLOAD_DEFAULTS[workload(values.get("data"))].items():
        section = SECTION_OF[key]
        given = out.get(section, {})
        if isinstance(given, Section) and getattr(given, key) is None:
            out[section] = given.model_copy(update={key: value})
        elif isinstance(given, dict) and given.get(key) is None:
            out[section] = {**given, key: value}
    return out

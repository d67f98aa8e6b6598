"""The retraining run's one typed configuration: the flow's parameter schema (a form in the UI).

Its keys are grouped in sections, one per part of the run: data, model, plan, train,
nightly and cluster, with run_dir beside them. A key's name is unique across sections,
so it may be given bare (`epochs: 3`, `--set epochs=3`) or with its section
(`train: {epochs: 3}`, `--set train.epochs=3`); a Prefect deployment's parameters and
the UI's form take the sections. Defaults run the bundled amazon-video dataset on the
demo topology. Everything is checked when the config is built, before any stage starts:
a bad value raises an InputError naming the key, the value and what is accepted.
"""

from __future__ import annotations

import difflib
import math
from functools import cached_property
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardflow.config_sections import (
    SECTION_OF,
    SECTIONS,
    ClusterSection,
    DataSection,
    ModelSection,
    NightlySection,
    PlanSection,
    TrainSection,
    sectioned,
    with_workload_defaults,
)
from shardflow.errors import InputError, brief
from storage import versions

if TYPE_CHECKING:
    from shardflow.model.configs import OptimizerConfig
    from shardflow.planner.costmodel import StepShape
    from shardflow.planner.topology import Topology
    from shardflow.training.config import TrainConfig
    from storage.versions import RunLayout

DENSE_COPIES = 4  # weights, gradients and Adam's two moments
PROFILE_COUNT_BYTES = 8  # a profile counts each row's accesses in an int64


def _flat_keys_too(schema: dict) -> None:
    """The JSON schema a deployment's parameters are checked against (by the Prefect server, before a run is
    made) and the UI's form is drawn from: the sections, as the form shows them, and also the flat keys `shardflow
    run --set` takes (`epochs`, `train.epochs`): any name among those, each checked in full when the run starts
    (`_into_sections` puts it in its section); any other name is refused by the server."""
    from shardflow.config_sections import SECTION_OF

    names = [*schema["properties"], *SECTION_OF, *(f"{section}.{key}" for key, section in SECTION_OF.items())]
    schema["additionalProperties"] = True
    schema["propertyNames"] = {"enum": sorted(set(names))}


class RetrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_flat_keys_too)

    run_dir: str = Field("runs/retrain", description="profile, plan, checkpoints and the exported model go here: a "
                         "new or empty directory, or an earlier run's")
    data: DataSection = Field(default_factory=DataSection)
    model: ModelSection = Field(default_factory=ModelSection)
    plan: PlanSection = Field(default_factory=PlanSection)
    train: TrainSection = Field(default_factory=TrainSection)
    nightly: NightlySection = Field(default_factory=NightlySection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)

    @model_validator(mode="before")
    @classmethod
    def _into_sections(cls, values: object) -> object:
        return with_workload_defaults(sectioned(values)) if isinstance(values, dict) else values

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("an empty path; accepted: a directory of its own for the run (new or of an earlier run)")
        path = Path(v).expanduser().resolve()
        if path == path.parent or path == Path.home().resolve():
            raise ValueError(f"{path} is a file system root or the home directory; accepted: a directory of its own")
        if path.exists() and not path.is_dir():
            raise ValueError(f"{v} is a file; accepted: a directory (new or of an earlier run)")
        if other := versions.other_contents(path, 4):
            raise ValueError(f"{path} holds {', '.join(map(repr, other[:3]))}{' …' if len(other) > 3 else ''} and "
                             f"nothing of a run; accepted: a new or empty directory, or the run_dir of an earlier run")
        return v

    @model_validator(mode="after")
    def _batch_covers_devices(self) -> RetrainConfig:
        from shardflow.training.config import check_batch

        try:
            devices = self.parsed_topology.devices
        except InputError as e:
            raise ValueError(str(e)) from None
        try:
            check_batch(self.train.batch_size, devices)
        except InputError as e:
            raise ValueError(f"{e} (a trainer per device of {self.plan.topology})") from None
        return self

    @model_validator(mode="after")
    def _cluster_fits_topology(self) -> RetrainConfig:
        from shardflow.cluster_options import check_workers_fit

        c = self.cluster
        try:
            check_workers_fit(c.cluster_class, c.cluster_kwargs, self.parsed_topology.devices)
        except InputError as e:
            raise ValueError(f"{e} ({self.plan.topology})") from None
        return self

    @model_validator(mode="after")
    def _transport_encrypted(self) -> RetrainConfig:
        c = self.cluster
        if self.train.transport == "collective" and c.tls_ca_file is not None:
            raise ValueError("transport = 'collective' with the cluster's TLS files; accepted: transport 'actor' "
                             "(the gloo group carries rows unencrypted; the actor calls go over the cluster's TLS)")
        return self

    @model_validator(mode="after")
    def _encoder_fits(self) -> RetrainConfig:
        if self.model.encoder != "mean" and self.data.dataset_format == "criteo":
            raise ValueError(f"encoder = {self.model.encoder!r} for a criteo click log; accepted: mean (the encoder "
                             "is the sequence model's; click logs train the DLRM)")
        if self.nightly.promote_on != "auc" and (self.data.dataset_format == "criteo" or self.data.click_label
                                                 or self.train.full_ranking == "off"):
            raise ValueError(f"promote_on = {self.nightly.promote_on!r} with dataset_format "
                             f"{self.data.dataset_format!r}, click_label {self.data.click_label!r}, full_ranking "
                             f"{self.train.full_ranking!r}; accepted: auc, or a sequence dataset ranked among the "
                             "whole catalog (full_ranking exclude-seen or include-seen)")
        if self.model.loss != "bce" and self.data.dataset_format == "criteo":
            raise ValueError(f"loss = {self.model.loss!r} for a criteo click log; accepted: bce (a click is a label "
                             "of its own example, not one item among candidates)")
        return self

    @model_validator(mode="after")
    def _fits_memory(self) -> RetrainConfig:
        """A step's working set and the dense model must fit this machine's memory (a bound, checked before
        anything is read or written: negatives = 10^9 once grew a run past 4.5 GB in 19 s)."""
        import psutil

        devices = self.parsed_topology.devices
        need = self.step_bytes(devices) + self.dense_bytes()
        have = psutil.virtual_memory().total
        if need > have:
            m = self.model
            raise ValueError(
                f"a training step needs about {need / 1e9:,.1f} GB (batch_size {self.train.batch_size} over "
                f"{devices} devices × (history {m.history} + 1 + negatives {m.negatives}) rows × dim {m.dim}, and "
                f"the dense layers {list(m.mlp)} / {list(m.bottom_mlp)}); this machine has {have / 1e9:,.1f} GB; "
                "accepted: smaller batch_size, history, negatives, dim or layers"
            )
        return self

    @model_validator(mode="after")
    def _hashed_tables_fit(self) -> RetrainConfig:
        """A click log's hashed table of hash_rows rows, with its optimizer state and its profile's count per row,
        must fit half this machine's memory: profiling and training hold it whole across the devices
        (hash_rows = 10^9 once grew each profiling worker past 8 GiB)."""
        import psutil

        from shardflow.planner.sharding_plan import row_bytes

        rows = self.data.hash_rows
        if self.data.dataset_format != "criteo" or rows == "exact":
            return self
        per_row = row_bytes(self.model.dim, self.train.row_optimizer) + PROFILE_COUNT_BYTES
        have = psutil.virtual_memory().total // 2
        if rows * per_row > have:
            raise ValueError(
                f"hash_rows = {rows:,}: a table of {rows:,} rows × {per_row} bytes (dim {self.model.dim} with its "
                f"{self.train.row_optimizer} state and access count) is {rows * per_row / 1e9:,.1f} GB, over half "
                f"this machine's memory ({have / 1e9:,.1f} GB); accepted: at most {have // per_row:,} rows"
            )
        return self

    # -- each stage's part of the config, as the value that stage takes -------------------------
    @property
    def layout(self) -> RunLayout:
        """The run_dir's stores and files."""
        from storage.versions import RunLayout

        return RunLayout(Path(self.run_dir))

    @cached_property
    def parsed_topology(self) -> Topology:
        """The topology file, read and checked once per config."""
        from shardflow.planner.topology import load_topology

        return load_topology(self.plan.topology)

    def step_shape(self) -> StepShape:
        """What the planner prices a step by."""
        from shardflow.planner.costmodel import StepShape

        return StepShape(self.train.batch_size, self.model.dim, self.plan.dedup, self.train.row_optimizer)

    def plan_options(self) -> dict:
        """The planning stage's keyword arguments besides the profile and the topology."""
        return {"shape": self.step_shape(), "memory_slack": self.plan.memory_slack, "history": self.model.history,
                "negatives": self.model.negatives}

    def optimizer(self) -> OptimizerConfig:
        from shardflow.model.configs import OptimizerConfig

        t = self.train
        return OptimizerConfig(row_lr=t.row_lr, rows=t.row_optimizer, dense=t.dense_optimizer, dense_lr=t.dense_lr)

    def training(self, window: tuple[int, int] = (0, 0)) -> TrainConfig:
        """The engine's part: a version trains from segment window[0] and is evaluated from window[1]."""
        from shardflow.training.config import TrainConfig, resolve_transport

        t = self.train
        transport = resolve_transport(t.transport, t.early_answers, encrypted=self.cluster.tls_ca_file is not None)
        return TrainConfig(batch_size=t.batch_size, dedup=self.plan.dedup, early_answers=t.early_answers,
                           transport=transport,
                           epochs=t.epochs, steps_per_epoch=t.steps_per_epoch, device=t.device, seed=t.seed,
                           eval_users=t.eval_users, window=tuple(window), patience=t.patience,
                           min_epochs=t.min_epochs, full_ranking=t.full_ranking)

    def encoder_options(self) -> dict:
        """The sequence model's encoder and loss, as shardflow.model.configs.ModelConfig names them."""
        m = self.model
        return {"encoder": m.encoder, "blocks": m.attention_blocks, "heads": m.attention_heads, "dropout": m.dropout,
                "item_dropout": m.item_dropout, "loss": m.loss, "gbce_t": m.gbce_t}

    def step_bytes(self, devices: int) -> int:
        """A bound on one trainer's working set in a step (bytes)."""
        from shardflow.model.sizes import step_bytes

        m = self.model
        blocks = m.attention_blocks if m.encoder == "self-attention" else 0
        return step_bytes(-(-self.train.batch_size // devices), m.dim, m.history, m.negatives, blocks,
                          m.attention_heads)

    def dense_bytes(self) -> int:
        """The dense layers' weights, gradients and optimiser state (bytes), for either workload's model."""
        m = self.model
        params = 0
        for widths in ((3 * m.dim, *m.mlp, 1), (m.dim, *m.bottom_mlp, m.dim)):
            params += sum(a * b + b for a, b in pairwise(widths))
        if m.encoder == "self-attention":
            from shardflow.model.sizes import attention_shapes

            shapes = attention_shapes(m.dim, m.history, m.attention_blocks)
            params += sum(math.prod(s) for s in shapes.values())
        return params * 4 * DENSE_COPIES

    def flat(self) -> dict:
        """Every key by its bare name, JSON values (what records store: the names are unique across sections)."""
        values = self.model_dump(mode="json")
        return {"run_dir": values.pop("run_dir"), **{k: v for section in values.values() for k, v in section.items()}}

    @classmethod
    def build(cls, values: dict) -> RetrainConfig:
        """The config from plain values, or an InputError listing every bad key (and, if a key is unknown, the
        keys there are: a bad value's own message says what it accepts)."""
        try:
            return cls.model_validate(values)  # not cls(**values): a YAML key may be a number
        except ValidationError as e:
            problems = "; ".join(_problem(err) for err in e.errors())
            keys = ""
            if any(err["type"] == "extra_forbidden" for err in e.errors()):
                keys = (f" (keys: {', '.join([*SECTION_OF, 'run_dir'])}; each bare or as SECTION.KEY, "
                        f"sections {', '.join(SECTIONS)})")
            raise InputError(f"bad configuration: {problems}{keys}") from None


def _unknown_hint(loc: list[str]) -> str:
    """Where an unknown key belongs: a key of another section (`data.epochs`), or a near spelling of a key or a
    section (`trian`, `epoch`)."""
    name = loc[-1]
    if len(loc) == 2 and SECTION_OF.get(name, loc[0]) != loc[0]:
        return f" in section {loc[0]}; accepted: {SECTION_OF[name]}.{name}, or {name} bare"
    near = difflib.get_close_matches(name, [*SECTION_OF, *SECTIONS, "run_dir"], n=1, cutoff=0.75)
    return f"; did you mean {near[0]}?" if near else ""


def _problem(err: dict) -> str:
    """One validation error: the key, the value and the message; a check across keys has no single value."""
    where = ".".join(str(p) for p in err["loc"]) or "config"
    message = err["msg"].removeprefix("Value error, ")  # pydantic's prefix to a validator's own ValueError
    if err["type"] == "extra_forbidden":
        message += _unknown_hint([str(p) for p in err["loc"]])
    if err["type"] in ("tuple_type", "list_type"):  # `--set mlp=64,32`, `--set bottom_mlp=32`
        section, key = (str(p) for p in err["loc"][-2:])
        message += f"; accepted: a list in brackets, e.g. {key}={list(SECTIONS[section].model_fields[key].default)}"
    if err["type"] == "value_error" and isinstance(err.get("input"), dict):
        return f"{where}: {message}"
    if err["type"] == "invalid_key":  # YAML's `1: 2`, `null: 2`
        return f"key {where} ({type(err.get('input')).__name__}); accepted: a key's name, e.g. epochs"
    return f"{where} = {brief(err.get('input'))}: {message}"

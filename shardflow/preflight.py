"""Every check that can refuse a retraining run before it writes anything (the config's own checks aside:
shardflow.config; what the source and the run_dir's dataset hold: shardflow.importing).

Each check raises an InputError naming the value and what is accepted; none writes.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from shardflow.cluster_options import LOCAL_CLASSES, check_local_workers
from shardflow.config import RetrainConfig
from shardflow.config_sections import workload
from shardflow.data.clicks import (
    exported_record,
    load_training_data,
    model_config,
    shape_differences,
    warm_start_record,
)
from shardflow.errors import InputError
from shardflow.importing import dataset_store, import_options, imported_source, same_source, source_parts
from shardflow.model.configs import ClickConfig, ModelConfig, dense_state_copies
from shardflow.planner.memory import WORKER_EXTRA_BYTES, check_capacity, worker_peak_bytes
from shardflow.planner.sharding_plan import VALUE_BYTES, row_bytes
from shardflow.training.config import check_batch
from storage import versions
from storage.checkpoint import EXPORT, complete_checkpoints, read_export_manifest
from storage.dataset import Dataset
from storage.importers import check_continuation
from storage.manifest import MANIFEST
from storage.sources import require_finished
from storage.staging import check_destination


def check_run(config: RetrainConfig) -> None:
    """Everything a run can refuse before its first write, beyond the config's own checks.

    The run_dir's dataset must be a shardflow store (or absent, or empty): a directory of
    someone else's files where it would go is never replaced; `versions` must hold only
    model versions. The dataset must continue the run_dir's own (check_dataset).
    """
    where = Path(config.run_dir).expanduser().resolve()
    while not where.exists():
        where = where.parent
    if not os.access(where, os.W_OK):
        raise InputError(f"run_dir {config.run_dir}: {where} cannot be written (a read-only file system or "
                         "permissions); accepted: a directory this user can write")
    try:
        check_destination(config.layout.dataset, overwrite=True)
    except InputError as e:
        raise InputError(f"run_dir {config.run_dir}: {e}") from None
    root = Path(config.run_dir) / versions.VERSIONS
    foreign = sorted(p.name for p in root.iterdir() if not (p.name.isdigit() and len(p.name) == 4)) \
        if root.is_dir() else []
    if foreign:
        raise InputError(f"run_dir {config.run_dir}: {root} holds {', '.join(foreign[:5])}, not model versions; "
                         "accepted: a versions directory shardflow made (NNNN subdirectories only), or a new run_dir")
    check_local_cluster(config)
    check_dataset(config)
    check_model_shape(config)
    check_budget(config)


def check_local_cluster(config: RetrainConfig) -> None:
    """Refuse what a cluster of this machine's processes (none named, or a local cluster class) would refuse
    only once the run has imported its data and recorded its version, or take in silence: more devices than
    this machine takes processes for; a sequence model's step that alone outgrows what a local cluster's
    worker may use (the engine's check_worker_memory, less the shard the plan gives it); `device: cuda` where
    PyTorch sees no GPU, as `shardflow train` does. Workers elsewhere (a scheduler_address, a remote class)
    judge their own."""
    cluster = config.cluster
    if cluster.scheduler_address is not None or cluster.cluster_class not in (None, *LOCAL_CLASSES):
        return
    devices = config.parsed_topology.devices
    try:
        check_local_workers(devices)
    except InputError as e:
        raise InputError(f"topology {config.plan.topology}: {e}") from None
    if cluster.cluster_class is None and workload(config.data) == "sequences":
        import psutil

        total = psutil.virtual_memory().total
        limit, step = total // devices, config.step_bytes(devices)  # Dask's 'auto': the machine's share
        if worker_peak_bytes(0, step=step) > limit:
            m = config.model
            raise InputError(
                f"a training step needs about {step / 2**30:,.2f} GiB on each of the {devices} devices (batch_size "
                f"{config.train.batch_size} over them × (history {m.history} + 1 + negatives {m.negatives}) rows × "
                f"dim {m.dim}, with the encoder's activations) and its worker {WORKER_EXTRA_BYTES / 1e9:.1f} GB "
                f"more, but a local cluster's worker may use {limit / 2**30:,.2f} GiB (this machine's "
                f"{total / 2**30:,.1f} GiB over {devices} workers); accepted: smaller batch_size, history, "
                "negatives or dim, or a cluster of larger workers (scheduler_address or cluster_class)")
    if config.train.device == "cuda":
        from shardflow.training.device import torch_device

        torch_device(config.train.device)


def check_budget(config: RetrainConfig) -> None:
    """Refuse, before any write, tables that cannot fit the topology's device_memory_bytes on all its devices.

    Known before the run when the dataset is a store, or was imported into the run_dir
    already (an append can only add rows: the plan checks again after it).
    """
    topology = config.parsed_topology
    if topology.device_memory_bytes is None:
        return
    store = dataset_store(config)
    if store is None:
        return
    rows = sum(t.rows for t in Dataset.open(store).info.tables)
    check_capacity(rows, config.model.dim, topology, topology.device_memory_bytes, f"the tables of {store}",
                   config.plan.topology, config.optimizer().rows)


# The run config's names for a model record's keys where they differ (shardflow.data.clicks.model_config).
CONFIG_NAMES = {"bottom": "bottom_mlp", "blocks": "attention_blocks", "heads": "attention_heads",
                "features": "the dataset's tables"}


def check_model_shape(config: RetrainConfig) -> None:
    """Refuse, before any write, a model the promoted version cannot warm-start (another dimension, MLP, ...):
    the run's model as it would be built on the run's dataset beside the promoted export's, by the engine's
    own rule (shardflow.data.clicks.shape_differences)."""
    promoted = versions.current(config.run_dir)
    store = dataset_store(config)
    if promoted is None or store is None:
        return
    theirs = exported_record(read_export_manifest(versions.version_dir(config.run_dir, promoted) / EXPORT))
    mine = warm_start_record(run_model(config, Dataset.open(store)), config.train.dense_optimizer,
                             config.optimizer().rows)
    differ = shape_differences(mine, theirs)
    if differ:
        def values(record: dict[str, Any]) -> str:
            return ", ".join(f"{CONFIG_NAMES.get(k, k)} = {_plain(record.get(k))!r}" for k in differ)

        raise InputError(
            f"run_dir {config.run_dir}: its current model version {promoted} has {values(theirs)}, this run "
            f"{values(mine)}; a new version warm-starts from the current one. Accepted: the same values, or a new "
            "run_dir (a cold start)"
        )


def run_model(config: RetrainConfig, ds: Dataset) -> ModelConfig | ClickConfig:
    """The model the run trains on `ds`, as the engine builds it (shardflow.data.clicks.model_config)."""
    m = config.model
    return model_config(ds, dim=m.dim, mlp=tuple(m.mlp), bottom=tuple(m.bottom_mlp), history=m.history,
                        negatives=m.negatives, seed=config.train.seed, encoder=config.encoder_options())


def check_training_examples(config: RetrainConfig, dataset: str, window: tuple[int, int]) -> None:
    """Refuse a global batch of more examples than a version's training window holds once the window is known,
    before the version's profile and plan are made (the engine's own check, which would come after them)."""
    ds = Dataset.open(dataset)
    train = config.training(window)
    data = load_training_data(ds, run_model(config, ds).features, window, validation=train.validation)
    check_batch(train.batch_size, config.parsed_topology.devices, data.targets)


def check_disk(config: RetrainConfig, dataset: str, version_dir: str | Path) -> None:
    """Refuse a version whose checkpoints and export cannot fit the free space of its directory, once the
    dataset's rows are known and before the profile. The least it needs on disk at once is a copy of the model
    (the rows and the dense layers, each with its optimizer's state) for each of keep_checkpoints checkpoints
    (every epoch's without retirement; at most the epochs) and one more, the checkpoint being written or the
    export, less the checkpoints of the version already complete."""
    ds = Dataset.open(dataset)
    rows = sum(t.rows for t in ds.info.tables)
    optimizer = config.optimizer()
    per_row = row_bytes(config.model.dim, optimizer.rows)
    dense_values = sum(math.prod(s) for s in run_model(config, ds).dense_shapes().values())
    dense = dense_values * VALUE_BYTES * (1 + dense_state_copies(optimizer.dense))
    epochs, keep = config.train.epochs, config.train.keep_checkpoints
    copies = max((epochs if keep is None else min(epochs, keep)) + 1 - len(complete_checkpoints(version_dir)), 1)
    copy = rows * per_row + dense
    free = shutil.disk_usage(version_dir).free
    if copies * copy > free:
        raise InputError(
            f"run_dir {config.run_dir}: this version writes at least {_size(copies * copy)} ({copies} copies of "
            f"the model on disk at once, checkpoints and the export, each {_size(copy)}: {rows:,} rows × {per_row} "
            f"bytes, dim {config.model.dim} with its {optimizer.rows} state, and {_size(dense)} of dense layers with "
            f"their {optimizer.dense} state) and {_size(free)} is free there; accepted: more free space, a smaller "
            "model (model.dim; a click log's data.hash_rows) or fewer checkpoints at once (train.keep_checkpoints)")


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _plain(value: object) -> object:
    """A record's value as the run config spells it (widths as lists)."""
    return list(value) if isinstance(value, tuple) else value


def check_dataset(config: RetrainConfig) -> None:
    """Refuse, before anything is written, a dataset that does not continue the run_dir's own.

    The run_dir's imported dataset grows only by new parts of the same source; a source
    whose parts vanished or changed is refused (storage.importers.check_continuation), and
    so is another source once the run_dir holds model versions trained on its own. A
    dataset store given as such is checked by check_versions. A first import that would read
    nothing (no part finished yet) is refused here too, before `shardflow run` starts its API.
    """
    source, dest = Path(config.data.dataset), config.layout.dataset
    if (source / MANIFEST).is_file():
        check_versions(config, str(source))
        return
    known = imported_source(config)
    if known is None:  # a first import: refused now, not once the API and the flow have started, if it reads nothing
        require_finished(source, source_parts(config, None))
        return
    if same_source(known, config):
        check_continuation(config.data.dataset_format, source, dest, source_parts(config, known), known,
                           import_options(config))
    elif versions.numbers(config.run_dir):
        raise InputError(
            f"run_dir {config.run_dir} was trained on {known.get('path')} ({known.get('format')}); dataset "
            f"{config.data.dataset} ({config.data.dataset_format}) is another one; accepted: that dataset (or a "
            "directory of its parts with new ones), or a new run_dir"
        )


def check_versions(config: RetrainConfig, dataset_store: str) -> None:
    """Refuse a dataset store the run_dir's versions were not trained on, or one that changed underneath them
    (other than by 'shardflow import --replace-from', which the store records).

    For a dataset given as a store (an imported source is checked part by part by
    storage.importers.check_continuation instead).
    """
    run = config.run_dir
    made = [versions.began(run, n) for n in versions.numbers(run)]
    if not made:
        return
    last = made[-1]
    if last.dataset != str(Path(dataset_store).resolve()):
        raise InputError(
            f"run_dir {run} holds model versions of dataset {last.dataset}; dataset {dataset_store} is another "
            "store. Accepted: that dataset (grown with 'shardflow import --append'), or a new run_dir"
        )
    ds = Dataset.open(dataset_store)
    have = [s.checksum for s in ds.segments]
    differs = next((i for i, (a, b) in enumerate(zip(have, last.segments, strict=False)) if a != b),
                   None if len(have) >= len(last.segments) else len(have))
    replaced = [r["segment"] for r in ds.info.source.get("replaced", [])] if isinstance(ds.info.source, dict) else []
    if differs is not None and not any(k <= differs for k in replaced):
        raise InputError(
            f"dataset {dataset_store} no longer starts with the {len(last.segments)} parts version "
            f"{last.version} of run_dir {run} was trained on (a part was changed or re-imported); accepted: "
            "the dataset grown only by appends, or a new run_dir"
        )

"""What outlives an engine: checkpoints, restores, warm starts and the parameter download (export).

Every shard writes and reads its own part, so no process ever gathers the model. Each
store is built in a staging directory beside its path, its manifest written last and
the directory renamed into place (storage.staging): a store cut off at any point is a
leftover staging directory, never the store.

`Persistence` is the part of shardflow.training.engine.Engine that does this; it uses
the engine's actors (`actors`, `_wait`, `_all`), its configuration (`model`, `train`,
`plan`, `topology`, `optimizer`) and its counts, which `EngineParts` names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from shardflow.data.clicks import config_record, exported_record, read_record, shape_differences, warm_start_record
from shardflow.errors import InputError
from shardflow.model.configs import ClickConfig, ModelConfig, OptimizerConfig
from shardflow.model.optim import row_state_shape
from shardflow.planner.sharding_plan import ShardingPlan
from shardflow.planner.topology import Topology
from shardflow.training.config import TrainConfig
from storage.checkpoint import (
    EXPORT_CHUNK_ROWS,
    CheckpointManifest,
    ExportManifest,
    chunk_rows_for,
    create_export,
    finish,
    read_checkpoint,
    sealed,
    write_arrays,
)
from storage.staging import for_workers, staged


class EngineParts(Protocol):
    """What Persistence's methods read and write of the engine they are part of."""

    actors: list[Any]  # one DeviceActor handle per device
    model: ModelConfig | ClickConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    plan: ShardingPlan
    topology: Topology
    step_count: int
    downloads: int

    def _all(self, method: str, *args: object) -> list[Any]: ...

    def _wait(self, calls: list[Any]) -> list[Any]: ...


class Persistence:
    def checkpoint(self: EngineParts, path: str | Path, epochs_done: int,
                   figures: dict[str, Any] | None = None) -> CheckpointManifest:
        """Every shard writes itself into a staging directory beside `path`; the manifest, with what the epoch
        measured (`figures`: CheckpointManifest's figure fields), is written last and the directory renamed to
        `path` (replacing a damaged checkpoint a resume skipped).

        A checkpoint cut off at any point is a leftover staging directory, never `path`.
        """
        with staged(Path(path), overwrite=True) as stage:
            saved = self._all("save", for_workers(stage))
            manifest = CheckpointManifest(
                **(figures or {}), epochs_done=epochs_done, step=self.step_count,
                dense_steps=saved[0]["dense_steps"], devices=self.topology.devices, model=config_record(self.model),
                batch_size=self.train.batch_size, seed=self.train.seed,
                **sealed({k: v for s in saved for k, v in s["digests"].items()}))
            finish(stage, manifest)
            return manifest

    def restore(self: EngineParts, path: str | Path) -> tuple[CheckpointManifest, bool]:
        """Load every shard from the complete checkpoint at `path`; its manifest, and whether rows moved.

        A checkpoint written under this plan is read in place, shard by shard. One written
        under another plan (a topology that lost or gained devices since) is moved onto this
        one: each shard takes its rows from the checkpoint's shards that hold them
        (shardflow.training.rehome). Either way every shard of the checkpoint is verified
        before any is read: a damaged checkpoint changes nothing.
        """
        m = read_checkpoint(path)
        mine, theirs = config_record(self.model), read_record(m.model)
        carries_ids = any(k.endswith("/ids") for k in m.arrays)
        if theirs != mine or (m.devices != self.topology.devices and not carries_ids):
            raise InputError(
                f"{path}: checkpoint of model {theirs} on {m.devices} devices; accepted: model {mine} "
                f"on {self.topology.devices} devices (the run's configuration)"
            )
        P = len(self.actors)
        where = for_workers(path)
        self._wait([self.actors[k % P].verify(where, m.arrays, k) for k in range(m.devices)])
        moved = self._wait([a.restore(where, m.arrays, m.devices, m.step, m.dense_steps) for a in self.actors])
        self.step_count = m.step
        return m, any(moved)

    def warm_start(self: EngineParts, model: str | Path, manifest: ExportManifest) -> None:
        """Start from an exported model (`manifest` is its verified manifest), placed onto this plan.

        Row r of a table takes the export's row r and its optimizer state where the export has
        it (the dataset's appends keep every raw id's row, so row r is the same item); rows
        added since keep their fresh initial values and a zero state. Each shard reads only
        the rows it stores, straight from the export store: the model is never gathered in
        one process. The dense layers and their optimiser state (and step count) are
        carried over: training goes on as if the new days had been more epochs, instead of
        a reset whose first Adagrad and Adam steps (about lr per coordinate) would throw
        the carried weights off.
        """
        mine = warm_start_record(self.model, self.optimizer.dense, self.optimizer.rows)
        theirs = exported_record(manifest)
        differ = shape_differences(mine, theirs)
        if differ:
            raise InputError(
                f"{model}: exported with {', '.join(f'{k}={theirs.get(k)!r}' for k in differ)}; accepted for a warm "
                f"start: {', '.join(f'{k}={mine[k]!r}' for k in differ)} (the run's configuration), or a cold start"
            )
        rows = manifest.tables
        grown = {t.name: t.rows for t in self.plan.tables}
        shrunk = sorted(name for name, n in rows.items() if n > grown.get(name, -1))
        if shrunk:
            raise InputError(f"{model}: tables {shrunk} have more rows than this dataset's; accepted: an export of "
                             "this dataset before an append")
        self._wait([a.warm_start(for_workers(model), rows, manifest.dense_steps) for a in self.actors])

    def export(self: EngineParts, out: str | Path, epochs: int | None = None, best_epoch: int | None = None,
               strategy: str | None = None) -> ExportManifest:
        """The parameter download: every table in global id order, chunk by chunk in parallel, with the
        optimiser state a later model version starts from (the rows' optimizer's, the dense optimiser's).

        Device d writes chunks d, d + P, d + 2P, ... of every table: it reads the rows it
        homes itself and asks the other homes for theirs, the next chunk's while it writes
        this one; no process holds more than two chunks of a table. Built beside `out` and
        swapped in when its manifest is written; the manifest names the epochs trained, the one
        kept and the plan's strategy as the caller gives them.
        """
        with staged(Path(out), overwrite=True) as stage:
            create_export(stage, {t.name: t.rows for t in self.plan.tables}, self.model.dim,
                          row_state_shape(self.optimizer.rows, self.model.dim))
            P = len(self.actors)
            chunks = {t.name: chunk_rows_for(t.rows) for t in self.plan.tables}
            calls = [a.write_export(for_workers(stage), t.name, list(range(d * chunks[t.name], t.rows,
                                                                           P * chunks[t.name])), chunks[t.name])
                     for t in self.plan.tables for d, a in enumerate(self.actors)]
            digests = {k: v for part in self._wait(calls) for k, v in part.items()}
            dense, dense_state, dense_steps = self._wait([self.actors[0].dense_parameters()])[0]
            digests.update(write_arrays(stage / "dense", dense, "dense"))
            digests.update(write_arrays(stage / "dense_opt", dense_state, "dense_opt"))
            manifest = ExportManifest(
                tables={t.name: t.rows for t in self.plan.tables}, dim=self.model.dim,
                model=config_record(self.model), dense_optimizer=self.optimizer.dense,
                row_optimizer=self.optimizer.rows, chunk_rows=EXPORT_CHUNK_ROWS, table_chunk_rows=chunks,
                dense_steps=dense_steps, epochs=epochs, best_epoch=best_epoch, strategy=strategy, **sealed(digests))
            finish(stage, manifest)
        self.downloads += 1
        return manifest

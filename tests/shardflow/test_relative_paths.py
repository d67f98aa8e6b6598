"""Relative paths on a cluster whose workers started elsewhere (any cluster but a local one started here): every
stage reads and writes the files the caller means, not files of the same names in the workers' own directory."""

from __future__ import annotations

import os
from pathlib import Path

from shardflow.planner.costmodel import StepShape
from shardflow.planner.topology import Node, Topology
from shardflow.profiling.profiles import profile_dataset
from shardflow.sharding.stage import make_plan
from shardflow.training.config import TrainConfig
from shardflow.training.evaluate import evaluate_export
from shardflow.training.recommend import recommend_export
from shardflow.training.run import prepare, start_engine
from storage.importers import import_dataset
from support import REAL

NAMES = ("parts", "ds", "ds.profile", "plan", "ckpt", "model", "lists")


def test_every_stage_on_workers_started_elsewhere_uses_the_callers_files(client, tmp_path, monkeypatch):
    workers_cwd = set(client.run(os.getcwd).values())
    monkeypatch.chdir(tmp_path)  # the workers keep the directory they started in
    assert str(tmp_path) not in workers_cwd
    lines = Path(REAL["sasrec"]).read_text().splitlines(keepends=True)[:6000]
    Path("parts").mkdir()
    Path("parts/day-1.txt").write_text("".join(lines[:3000]))
    Path("parts/day-2.txt").write_text("".join(lines[3000:]))

    import_dataset("sasrec", "parts", "ds", client=client)  # two parts: scanned and written on the workers
    profile_dataset("ds", "ds.profile", client=client)
    topology = Topology((Node("a", 2, 10.0),), 100.0)
    make_plan("ds.profile", "plan", topology, strategy="flexshard", shape=StepShape(256, 16, "device"),
              memory_slack=0.5, history=10, negatives=4)
    job = prepare("ds", "plan", TrainConfig(batch_size=256, max_steps=2, eval_users=100))
    with start_engine(client, job) as engine:
        engine.steps(0, 0, 2)
        engine.checkpoint("ckpt", 1)
        engine.restore("ckpt")
        engine.warm_start("model", engine.export("model"))
    assert evaluate_export("model", "ds", 100, 0, client=client).users == 100
    assert recommend_export("model", "ds", "lists", k=5, client=client)["users"] > 0

    assert all(Path(name).is_dir() for name in NAMES)
    # Nothing of these names made where the workers started: no store, no staging directory beside one.
    made_there = [f"{d}/{entry}" for d in workers_cwd for entry in os.listdir(d)
                  if entry.lstrip(".").split(".staging-")[0] in NAMES]
    assert not made_there, made_there


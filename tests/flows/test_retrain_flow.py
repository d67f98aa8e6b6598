"""The whole retraining flow under Prefect's test harness, on a small synthetic dataset."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import threading
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from prefect.client.orchestration import get_client

from flows.retrain import retrain
from runs import SMALL, TOPOLOGY, exported, live_actors, task_runs
from shardflow.config import RetrainConfig
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.lifecycle import nothing_new
from shardflow.reporting.run_report import artifact_key
from storage.checkpoint import epoch_records


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrain")
    synth_dataset(root / "ds", [SynthTable("item", 400, 1.1)], interactions=8000, seed=3, mean_length=12)
    (root / "topo.yaml").write_text(TOPOLOGY)
    return root


def config(base, run: str, client, **kw) -> RetrainConfig:
    values = dict(dataset=str(base / "ds"), run_dir=str(base / run), topology=str(base / "topo.yaml"),
                  scheduler_address=client.scheduler.address, **SMALL)
    return RetrainConfig.build({**values, **kw})


def artifacts(flow_run_id) -> set[str]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def keys():
        async with get_client() as c:
            found = await c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
            return {a.key for a in found if a.key}
    return asyncio.run(keys())


def artifact_rows(flow_run_id, key: str) -> list[dict]:
    """The rows of a table artifact of one flow run, its latest version (the text of a markdown one)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async def read():
        async with get_client() as c:
            found = await c.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
            return max(found, key=lambda a: a.created).data  # the latest version
    data = asyncio.run(read())
    try:
        return json.loads(data) if isinstance(data, str) else data
    except json.JSONDecodeError:  # a markdown artifact
        return data


def test_table_artifacts_have_the_same_columns_in_every_row(prefect_api, client, base):
    state = retrain(config(base, "tables", client, epochs=1), return_state=True)
    run = state.state_details.flow_run_id
    plans = artifact_rows(run, artifact_key("plan-comparison", base / "tables"))
    assert len({tuple(r) for r in plans}) == 1 and list(plans[0])[:2] == ["strategy", "plan"]
    flexshard = next(r for r in plans if r["strategy"] == "flexshard")
    # A cold start trains on its fresh plan (the configured strategy's row says so); numbers are text, one format.
    assert (flexshard["plan"], flexshard["trains"]) == ("made", "yes") and float(flexshard["MB_per_step"]) > 0
    assert [r["strategy"] for r in plans if r["trains"]] == ["flexshard"]
    assert all((r["plan"] == "made") == (r["MB_per_step"] != "") for r in plans)
    assert all(re.fullmatch(r"[\d,]+\.\d", r["comm_us"]) for r in plans if r["comm_us"]), plans
    versions_table = artifact_rows(run, artifact_key("versions", base / "tables"))
    assert float(versions_table[0]["full_ndcg_at_10"]) >= 0  # ranked among the whole catalog (the default)
    profiles = artifact_rows(run, artifact_key("profile", base / "tables"))
    assert all(re.fullmatch(r"0\.\d{3}", r["top_1pct_share"]) and re.fullmatch(r"[\d,]+", r["accesses"])
               for r in profiles), profiles
    summary = artifact_rows(run, artifact_key("retrain-summary", base / "tables"))  # markdown: the text itself
    embedded = re.findall(r"!\[(\w+)\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", summary)
    assert [name for name, _ in embedded] == ["access", "traffic", "training"]
    assert all(base64.b64decode(data).startswith(b"<svg") for _, data in embedded)


def test_progress_moves_during_epochs_and_every_epoch_is_in_the_metrics_table(prefect_api, client, base, monkeypatch):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    import tasks.training as stages

    monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 0.0)  # report after every step
    key = artifact_key("training-progress", base / "progress")
    done: dict = {}
    run = threading.Thread(
        target=lambda: done.update(state=retrain(config(base, "progress", client), return_state=True))
    )
    run.start()

    async def latest():
        async with get_client() as c:
            found = await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return [(a.data, a.description) for a in found]

    seen, descriptions = set(), set()
    while run.is_alive():  # what a person watching the UI sees, read through the API while the run goes on
        for data, description in asyncio.run(latest()):
            seen.add(data)
            descriptions.add(description)
        time.sleep(0.05)
    run.join()
    assert done["state"].is_completed()

    async def tags():
        async with get_client() as c:
            return set((await c.read_flow_run(done["state"].state_details.flow_run_id)).tags)
    assert {"strategy:flexshard", "dataset:ds"} <= asyncio.run(tags())
    values = sorted(float(x) for x in seen)
    assert len(values) > 2 and 0 < values[1] < 50 and values[-1] == 100.0  # moved within the epochs, ended done
    assert any(
        re.fullmatch(r"epoch [12]/2 · step \d+/\d+ · loss \d\.\d{3} · \d+k examples/s", d or "") for d in descriptions
    )
    metrics = artifact_rows(done["state"].state_details.flow_run_id, artifact_key("epoch-metrics", base / "progress"))
    assert [r["epoch"] for r in metrics] == [1, 2] and len({tuple(r) for r in metrics}) == 1
    assert all(r["auc"] and float(r["MB/step"]) > 0 and 0.95 < float(r["measured/modeled"]) < 1.05 for r in metrics)
    # No column no epoch has (a sequence model's log-loss, val_ without a validation split): the table fits the UI.
    assert "logloss" not in metrics[0] and not any(k.startswith("val_") for k in metrics[0]), metrics[0]
    assert all(re.fullmatch(r"[\d,]+", r["examples/s"]) for r in metrics), metrics
    assert (
        artifact_count(done["state"].state_details.flow_run_id, artifact_key("epoch-metrics", base / "progress")) == 1
    )


def artifact_count(flow_run_id, key: str) -> int:
    """How many artifacts of `key` one flow run made (each create is one; the UI lists every one)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async def read():
        async with get_client() as c:
            return len(await c.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key]))))
    return asyncio.run(read())


def test_resume_ends_with_the_parameters_of_an_uninterrupted_run(prefect_api, client, base):
    state = retrain(config(base, "whole", client), return_state=True)
    whole = state.result()
    assert whole["epochs"] == 2 and whole["downloads"] == 1 and len(whole["checkpoints"]) == 2
    assert 0 <= whole["auc"] <= 1 and whole["bytes_per_step"] > 0 and whole["row_wise_bytes_per_step"] > 0
    # Measured traffic is set against this plan's model (the engine's contract: within 5%), not another plan's.
    assert abs(whole["bytes_per_step"] / whole["modeled_bytes_per_step"] - 1) < 0.05
    assert 0 < whole["comm_time_us_per_step"] <= whole["row_wise_comm_time_us_per_step"]
    names = task_runs(state.state_details.flow_run_id)
    assert names.count("download") == 1
    assert {"start-cluster", "train-epoch-1", "train-epoch-2", "checkpoint-epoch-1", "checkpoint-epoch-2", "profile",
            "shard", "exit", "evaluate", "model-asset-v1"} <= set(names)
    # The summary is persisted as the flow's result (JSON), where the UI's Result tab and a later reader find it.
    assert json.loads(Path(state.data.metadata.storage_key).read_text()) == whole  # plain JSON, the summary
    report = Path(whole["dask_report"])  # distributed's performance report of the version's work, under it
    assert report.parent == base / "whole" / "versions" / "0001" and "Dask Performance Report" in report.read_text()
    kinds = ("profile", "plan-comparison", "training-progress", "retrain-summary")
    assert {artifact_key(k, base / "whole") for k in kinds} <= artifacts(state.state_details.flow_run_id)
    assert all(artifact_key(k, base / "whole") != artifact_key(k, base / "cut") for k in kinds)
    assert live_actors(client) == 0
    import xml.etree.ElementTree as ET

    assert [Path(p).name for p in whole["plots"]] == ["access.svg", "traffic.svg", "training.svg"]
    for p in whole["plots"]:
        assert len(ET.parse(p).findall("{http://www.w3.org/2000/svg}polyline")) + len(
            ET.parse(p).findall("{http://www.w3.org/2000/svg}rect")) > 2

    again_state = retrain(config(base, "whole", client), return_state=True)  # no new data: nothing to train
    again = again_state.result()
    assert again["trained"] is False and again["current"] == 1 and again["epoch_loss"] == []
    assert again["bytes_per_step"] == whole["bytes_per_step"]  # the last measured traffic, not 0
    assert not {"train-epoch-1", "download", "profile"} & set(task_runs(again_state.state_details.flow_run_id))

    # What a kill right after the first checkpoint leaves (test_faults kills runs for real):
    # the version's record, profile, plan and checkpoint 1; no result, no export, nothing promoted.
    full = retrain(config(base, "cut", client))
    version = Path(full["model"]).parent
    for gone in (version / "checkpoints" / "epoch-000002", version / "model", version / "plots"):
        shutil.rmtree(gone)
    (version / "result.json").unlink()
    (base / "cut" / "current").unlink()
    second_state = retrain(config(base, "cut", client), return_state=True)
    second = second_state.result()
    names = task_runs(second_state.state_details.flow_run_id)
    assert "train-epoch-1" not in names and "train-epoch-2" in names and names.count("download") == 1
    assert second["version"] == 1 and second["resumed_from"].endswith("epoch-000001")
    assert second["checkpoints"][-1].endswith("epoch-000002") and second["promoted"] and second["current"] == 1
    assert exported(second["model"]) == exported(whole["model"])


def test_early_stopping_keeps_the_best_epoch_and_a_resumed_run_stops_where_an_uninterrupted_one_did(
        prefect_api, client, base):
    def mean(run: str, **kw) -> RetrainConfig:  # peaks within 8 epochs here (the defaults' model still gains)
        return config(base, run, client, encoder="mean", loss="bce", row_optimizer="adagrad", **kw)

    stops = retrain(mean("early", epochs=8, patience=1, keep_checkpoints=1))
    best = stops["best_epoch"]
    assert stops["epochs"] == best + 1 < 8 and len(stops["epoch_loss"]) == stops["epochs"]
    assert stops["val_ndcg_at_10"] is not None and stops["val_auc"] is not None and stops["ndcg_at_10"] is not None
    # keep_checkpoints 1: the newest checkpoint and the best one are kept; every other epoch is retired, its
    # record kept, its shards deleted.
    version = Path(stops["model"]).parent
    assert [Path(p).name for p in stops["checkpoints"]] == [f"epoch-{e:06d}" for e in (best, best + 1)]
    assert sorted(p.parent.name for p in (version / "checkpoints").glob("*/shards")) == [
        f"epoch-{e:06d}" for e in (best, best + 1)]
    # Epochs chosen on the validation split ranked among the whole catalog (full_ranking's default), read back
    # from the checkpoints' manifests, the retired ones' included.
    scores = {e: m.val_full_ndcg_at_10 for e, m in epoch_records(version)}
    assert sorted(scores) == list(range(1, best + 2))
    assert best == max(sorted(scores), key=lambda e: (scores[e], -e)) and stops["val_full_ndcg_at_10"] == scores[best]
    assert json.loads((Path(stops["model"]).parent / "result.json").read_text())["best_epoch"] == best
    # Trained to the best epoch and no further, the same split and seed give the same parameters: the
    # export is the best epoch's, not the last one's.
    upto = retrain(mean("upto", epochs=best, patience=best))
    assert upto["best_epoch"] == best and exported(upto["model"]) == exported(stops["model"])
    # With min_epochs past where it stopped, the same epochs score the same and training goes on through them.
    warm = retrain(mean("warm", epochs=8, patience=1, min_epochs=best + 2, keep_checkpoints=None))
    assert 8 >= warm["epochs"] >= best + 2 and len(warm["checkpoints"]) == warm["epochs"], warm["epochs"]
    assert warm["best_epoch"] >= best
    # Cut off after its last checkpoint: the resumed run reads the scores back, the retired epochs' too, and
    # trains nothing more.
    for gone in (version / "model", version / "plots"):
        shutil.rmtree(gone)
    (version / "result.json").unlink()
    (base / "early" / "current").unlink()
    state = retrain(mean("early", epochs=8, patience=1), return_state=True)
    again = state.result()
    names = task_runs(state.state_details.flow_run_id)
    assert not [n for n in names if n.startswith("train-epoch")] and "keep-best-epoch" in names
    assert again["best_epoch"] == best and exported(again["model"]) == exported(stops["model"])


def test_a_failing_run_releases_its_parameter_servers(prefect_api, client, base):
    state = retrain(config(base, "fails", client, row_lr=1e30, dense_lr=1e30, epochs=3), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="non-finite|the loss is"):
        state.result()
    assert live_actors(client) == 0
    assert not (base / "fails" / "versions" / "0001" / "model").exists() and not (base / "fails" / "current").exists()
    # The operator's page of a failed night: what failed in one line, what stays current, what comes next.
    text = artifact_rows(state.state_details.flow_run_id, artifact_key("retrain-summary", base / "fails"))
    lines = text.splitlines()
    assert lines[0].endswith(": **failed**") and re.match(r"- what failed: \w+: .*(non-finite|the loss is)", lines[2])
    assert lines[3] == "- no version is current yet"
    assert lines[4] == "- the next run starts version 1 again from the beginning (no checkpoint of it was complete)"


def test_a_batch_larger_than_the_training_examples_fails_before_the_cluster_starts(prefect_api, client, base):
    state = retrain(config(base, "big-batch", client, batch_size=10**6), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"batch size 1000000 > \d+ training examples; accepted: at most \d+"):
        state.result()
    version = base / "big-batch" / "versions" / "0001"
    assert sorted(p.name for p in version.iterdir()) == ["version.json"]  # no profile, plan or Dask report
    ran = task_runs(state.state_details.flow_run_id)
    assert "open-version" in ran and [t for t in ran if t.startswith(("start-cluster", "profile", "shard"))] == []


def test_the_estimation_flow_puts_every_table_on_one_server(prefect_api, client, base):
    from flows.estimate import estimate

    s = estimate(config(base, "estimated", client, epochs=1))
    assert s["epochs"] == 1 and s["examples_per_s"] > 0 and s["bytes_per_step"] > 0 and len(s["epoch_loss"]) == 1
    assert not (base / "estimated" / "versions").exists()
    assert live_actors(client) == 0


def test_a_night_writes_every_users_top_k_as_parquet_and_the_cli_prints_one(prefect_api, client, base, tmp_path,
                                                                           monkeypatch):
    """The night's product: after the gate, each user's best unseen items from the current model, as Parquet any
    reader opens (pyarrow here, no shardflow code), and `shardflow recommend` for one user."""
    import pyarrow.parquet as pq

    from runs import BIN
    from storage import recommendations
    from storage.dataset import Dataset

    state = retrain(config(base, "lists", client, epochs=1, top_k=5), return_state=True)
    summary = state.result()
    store = Path(summary["recommendations"])

    # Every second of the run is in a stage: they add up to the flow run's wall time as the API records it.
    async def read():
        async with get_client() as c:
            return await c.read_flow_run(state.state_details.flow_run_id)
    made_run = asyncio.run(read())
    stages = summary["stage_seconds"]
    wall = (made_run.end_time - made_run.start_time).total_seconds()
    assert {"import and verify the data", "cluster start", "train (warm start, epochs, checkpoints, download)",
            "top-K lists", "Dask performance report, cluster stop"} <= set(stages), stages
    assert abs(sum(stages.values()) - wall) <= 0.05 * wall, (stages, wall)
    assert "Where the run's" in artifact_rows(state.state_details.flow_run_id,
                                              artifact_key("retrain-summary", base / "lists"))
    made = recommendations.read(store)
    ds = Dataset.open(base / "ds")
    assert store == Path(summary["run_dir"]) / "versions" / "0001" / "recommendations"
    assert (made["k"], made["version"], made["users"], made["users_from"]) == (5, 1, ds.info.users, "window")
    table = pq.read_table([str(f) for f in recommendations.files(store)])
    assert table.column_names == ["user", "rank", "item", "score"] and table.num_rows == 5 * ds.info.users
    rows = table.to_pylist()
    lists = {}
    for r in sorted(rows, key=lambda r: (r["user"], r["rank"])):
        lists.setdefault(r["user"], []).append(r)
    offsets, items = ds.offsets(), ds.ids("item")
    for user in (0, 17, ds.info.users - 1):
        mine = lists[str(user)]
        had = {str(i) for i in items[offsets[user]:offsets[user + 1]]}
        assert [r["rank"] for r in mine] == [1, 2, 3, 4, 5] and not had & {r["item"] for r in mine}
        assert all(a["score"] >= b["score"] for a, b in pairwise(mine))

    # The users' states are built STATE_USERS at a time (two passes here); in one pass, the same lists.
    from shardflow.training import recommend, user_states
    assert ds.info.users > user_states.STATE_USERS
    monkeypatch.setattr(user_states, "STATE_USERS", ds.info.users)
    model = Path(summary["run_dir"]) / "versions" / "0001" / "model"
    recommend.recommend_export(model, base / "ds", tmp_path / "one-pass", k=5)
    one_pass = pq.read_table([str(f) for f in recommendations.files(tmp_path / "one-pass")]).to_pylist()
    key = {(r["user"], r["rank"]): r["score"] for r in rows}
    assert len(one_pass) == len(rows)
    assert np.allclose([r["score"] for r in one_pass], [key[r["user"], r["rank"]] for r in one_pass], atol=1e-5)

    shown = subprocess.run([str(BIN / "shardflow"), "recommend", summary["run_dir"], "--user", "17", "--k", "3",
                            "--json"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    printed = json.loads(shown.stdout)
    assert printed["user"] == "17" and printed["version"] == 1
    assert [i["item"] for i in printed["items"]] == [r["item"] for r in lists["17"][:3]]
    for args, refusal in ((["--user", "no-such-user"], "user 'no-such-user': no list in "),
                          (["--user", "17", "--k", "0"], "--k 0; accepted: an integer >= 1"),
                          (["--user", "17", "--k", "6"], "--k 6; accepted: 1 to 5")):
        refused = subprocess.run([str(BIN / "shardflow"), "recommend", summary["run_dir"], *args], capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode == 2 and refusal in refused.stderr and "Traceback" not in refused.stderr, \
            refused.stderr[-2000:]

    # A night cut off after its gate, before its lists were in place (the store's rename is their last act), is
    # finished and promoted without them: the next run, with no new data, writes them, the same lists.
    shutil.rmtree(store)
    again = retrain(config(base, "lists", client, epochs=1, top_k=5), return_state=True).result()
    assert (again["trained"], again["version"], again["recommendations"]) == (False, 1, str(store))
    assert "top-K lists" in again["stage_seconds"]
    remade = pq.read_table([str(f) for f in recommendations.files(store)]).to_pylist()
    assert [(r["user"], r["rank"], r["item"]) for r in remade] == [(r["user"], r["rank"], r["item"]) for r in rows]
    assert nothing_new(config(base, "lists", client, epochs=1, top_k=5)) is not None  # and the next needs no flow


def test_a_rollback_run_carries_its_run_dir_version_and_outcome(prefect_api, client, base):
    """The rollback deployment's flow: named by run_dir and version, tagged, so the runs list says whose."""
    from flows.promote import promote_version
    from shardflow.reporting.run_report import run_label

    run = base / "rolled"
    retrain(config(base, "rolled", client, epochs=1, top_k=0))
    state = promote_version(str(run), 1, "test", return_state=True)

    async def read():
        async with get_client() as c:
            return await c.read_flow_run(state.state_details.flow_run_id)
    made = asyncio.run(read())
    assert made.name == f"{run_label(run)}·promote-v1" and {"version:1", "outcome:rolled-back"} <= set(made.tags)
    assert (made.state.name, made.state.message) == ("Rolled back", "v1 current (was v1) by " + state.result()["by"])

"""The retraining run against a real `prefect server start` (SQLite, loopback), read back through the API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.reporting.run_report import artifact_key, run_label
from storage.checkpoint import RETIRED

pytestmark = pytest.mark.server  # the tier: `shardflow run` or `prefect` as processes

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
OUTAGE_S = 15  # the Prefect client retries a refused connection for about a minute (2 + 4 + ... + 32 s)
DEPLOYMENTS = """
import asyncio, json
from prefect.client.orchestration import get_client
async def main():
    async with get_client() as c:
        out = {}
        for d in await c.read_deployments():
            s = await c.read_deployment_schedules(d.id)
            limit = d.concurrency_options.collision_strategy.value if d.concurrency_options else None
            out[d.name] = {"cron": [x.schedule.cron for x in s], "limit": d.global_concurrency_limit.limit
                           if d.global_concurrency_limit else None, "collision": limit, "pool": d.work_pool_name}
        print(json.dumps(out))
asyncio.run(main())
"""
SCHEDULED = """
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterName, FlowRunFilter, FlowRunFilterState,
                                            FlowRunFilterStateType)
from prefect.client.schemas.objects import StateType
async def main():
    async with get_client() as c:
        runs = await c.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly-retrain"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
        print(json.dumps(sorted(r.expected_start_time.isoformat() for r in runs)))
asyncio.run(main())
"""
READ_BACK = """
import asyncio, json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
async def main():
    async with get_client() as c:
        runs = await c.read_flow_runs()
        artifacts = await c.read_artifacts()
        print(json.dumps({"runs": [[r.name, r.state_type.value] for r in runs],
                          "artifacts": sorted({a.key for a in artifacts if a.key})}))
asyncio.run(main())
"""


def run_config(tmp_path: Path, **kw) -> Path:
    """A small dataset, a one-node two-device topology and a run config using them."""
    synth_dataset(tmp_path / "ds", [SynthTable("item", 300, 1.1)], interactions=5000, seed=5, mean_length=10)
    (tmp_path / "topo.yaml").write_text(
        "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "dataset": str(tmp_path / "ds"), "run_dir": str(tmp_path / "run"), "topology": str(tmp_path / "topo.yaml"),
        "dim": 8, "mlp": [8], "history": 5, "negatives": 2, "eval_users": 100, **kw,
    }))
    return tmp_path / "run.yaml"


def artifacts(server, key: str) -> list[dict]:
    """Every version of the artifacts under `key`, oldest first, as the UI's API returns them."""
    request = urllib.request.Request(f"{server.url}/artifacts/filter", method="POST",
                                     data=json.dumps({"artifacts": {"key": {"any_": [key]}}}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return sorted(json.loads(r.read()), key=lambda a: a["created"])


def test_a_run_on_a_real_server_leaves_its_artifacts_there(module_server, tmp_path):
    run_config(tmp_path, batch_size=64, epochs=3)
    run = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml"), "--json"],
                           env=module_server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress, key = set(), artifact_key("training-progress", tmp_path / "run")
    while run.poll() is None:  # what the UI shows while the run goes on
        progress |= {a["data"] for a in artifacts(module_server, key)}
        time.sleep(0.1)
    out, err = run.communicate()
    assert run.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert (
        summary["downloads"] == 1
        and summary["epochs"] == 3
        and summary["model"] == str(tmp_path / "run" / "versions" / "0001" / "model")
    )
    assert len(progress) > 2, progress
    back = subprocess.run(
        [sys.executable, "-c", READ_BACK], env=module_server.env, capture_output=True, text=True, timeout=120
    )
    assert back.returncode == 0, back.stderr[-3000:]
    seen = json.loads(back.stdout)
    assert [f"{run_label(tmp_path / 'run')}·v1", "COMPLETED"] in seen["runs"]
    kinds = ("profile", "plan-comparison", "training-progress", "retrain-summary", "epoch-metrics", "versions")
    assert {artifact_key(k, tmp_path / "run") for k in kinds} <= set(seen["artifacts"])
    for kind in (
        "profile",
        "plan-comparison",
        "epoch-metrics",
        "versions",
    ):  # the UI takes a table's columns from its first row
        rows = json.loads(artifacts(module_server, artifact_key(kind, tmp_path / "run"))[-1]["data"])
        assert len({tuple(r) for r in rows}) == 1, (kind, rows)
    assert [
        r["epoch"]
        for r in json.loads(artifacts(module_server, artifact_key("epoch-metrics", tmp_path / "run"))[-1]["data"])
    ] == [1, 2, 3]
    text = artifacts(module_server, artifact_key("retrain-summary", tmp_path / "run"))[-1]["data"]
    assert len(re.findall(r"!\[\w+\]\(data:image/svg\+xml;base64,", text)) == 3


def test_prefect_yaml_deploys_the_nightly_and_the_estimation_deployments(module_server):
    pool = subprocess.run([str(BIN / "prefect"), "work-pool", "create", "shardflow-process", "--type", "process"],
                          env=module_server.env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert pool.returncode == 0, pool.stderr[-2000:]
    deployed = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env=module_server.env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert deployed.returncode == 0, (deployed.stdout + deployed.stderr)[-3000:]
    back = subprocess.run(
        [sys.executable, "-c", DEPLOYMENTS], env=module_server.env, capture_output=True, text=True, timeout=120
    )
    assert back.returncode == 0, back.stderr[-3000:]
    found = json.loads(back.stdout)
    assert found["nightly-retrain"] == {"cron": ["0 2 * * *"], "limit": 1, "collision": "CANCEL_NEW",
                                        "pool": "shardflow-process"}
    assert found["estimate"]["pool"] == "shardflow-process"

    # The server's scheduler creates the nightly runs (it never did with SQLAlchemy 2.1: see pyproject.toml).
    deadline, scheduled = time.monotonic() + 90, []
    while len(scheduled) < 3 and time.monotonic() < deadline:
        time.sleep(2)
        back = subprocess.run(
            [sys.executable, "-c", SCHEDULED], env=module_server.env, capture_output=True, text=True, timeout=120
        )
        assert back.returncode == 0, back.stderr[-3000:]
        scheduled = [datetime.fromisoformat(t) for t in json.loads(back.stdout)]
    assert len(scheduled) >= 3, f"the scheduler created {len(scheduled)} nightly runs in 90 s"
    assert all((t.hour, t.minute, t.utcoffset()) == (2, 0, timedelta(0)) for t in scheduled)
    assert all(b - a == timedelta(days=1) for a, b in pairwise(scheduled))


def test_a_run_outlives_an_outage_of_the_prefect_api(server, tmp_path):
    run_config(tmp_path, batch_size=64, epochs=4)
    run = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml"), "--json"],
                           env=server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = tmp_path / "run" / "versions" / "0001" / "checkpoints" / "epoch-000001" / "manifest.json"
    deadline = time.monotonic() + 300
    while not first.exists():
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:] if run.poll() else "slow"
        time.sleep(0.05)
    written = first.stat().st_mtime_ns
    server.kill()
    time.sleep(OUTAGE_S)
    assert run.poll() is None, run.stderr.read()[-3000:]  # the run waits out the outage
    server.start()
    out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["epochs"] == 4 and summary["restarts"] == 0 and summary["downloads"] == 1
    assert [Path(p).name for p in summary["checkpoints"]] == ["epoch-000003", "epoch-000004"]  # keep_checkpoints 2
    # nothing redone: epoch 1 was not trained or written again (its manifest is now the retired epoch's record)
    assert (first.parent / RETIRED).stat().st_mtime_ns == written and len(summary["epoch_loss"]) == 4
    back = subprocess.run(
        [sys.executable, "-c", READ_BACK], env=server.env, capture_output=True, text=True, timeout=120
    )
    assert back.returncode == 0, back.stderr[-3000:]
    assert [f"{run_label(tmp_path / 'run')}·v1", "COMPLETED"] in json.loads(back.stdout)["runs"]


BLOCK = """
import sys
from prefect.blocks.notifications import CustomWebhookNotificationBlock
block = CustomWebhookNotificationBlock(name="shardflow-alerts", url=f"http://127.0.0.1:{sys.argv[1]}/alerts",
                                       json_data={"text": "{{body}}"})
print(block.save("shardflow-alerts", overwrite=True))
"""
AUTOMATIONS = """
import asyncio, json
from prefect.client.orchestration import get_client
async def main():
    async with get_client() as c:
        found = await c.read_automations()
        print(json.dumps([{"name": a.name, "trigger": a.trigger.model_dump(mode="json"),
                           "block": str(a.actions[0].block_document_id), "type": a.actions[0].type} for a in found]))
asyncio.run(main())
"""
NIGHTS = """
import asyncio
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State, StateType
@flow
def retrain(): ...
async def main():
    async with get_client() as c:  # an untagged run first: were it alerted on, its alert would come first
        for name, tags, state, kind in (("other-failed", [], "Failed", "FAILED"),
                                        ("night-failed", ["shardflow-nightly"], "Failed", "FAILED"),
                                        ("night-crashed", ["shardflow-nightly"], "Crashed", "CRASHED"),
                                        ("night-rejected", ["shardflow-nightly"], "Rejected", "COMPLETED"),
                                        ("night-promoted", ["shardflow-nightly"], "Promoted", "COMPLETED")):
            run = await c.create_flow_run(retrain, name=name, tags=tags)
            await c.set_flow_run_state(run.id, State(type=StateType[kind], name=state, message=f"{name} says"),
                                       force=True)
asyncio.run(main())
"""
TAG = "shardflow-nightly"  # prefect.yaml gives the nightly deployment's runs this tag


class Alerts:
    """A webhook on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.bodies: list[str] = []
        alerts = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                alerts.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["text"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_the_alerts_file_creates_the_nightly_automations_and_they_alert_on_the_nightly_runs(module_server,
                                                                                            tmp_path):
    alerts = Alerts()
    try:
        made = subprocess.run([sys.executable, "-c", BLOCK, str(alerts.port)], env=module_server.env,
                              capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr[-3000:]
        block_id = made.stdout.split()[-1]
        text = (ROOT / "automations.yaml").read_text()
        assert text.count("block_document_id: REPLACE_WITH_NOTIFICATION_BLOCK_ID") == 5
        (tmp_path / "a.yaml").write_text(text.replace("REPLACE_WITH_NOTIFICATION_BLOCK_ID", block_id))
        created = subprocess.run([str(BIN / "prefect"), "automation", "create", "--from-file",
                                  str(tmp_path / "a.yaml")], env=module_server.env, capture_output=True, text=True,
                                 timeout=120)
        assert created.returncode == 0, (created.stdout + created.stderr)[-3000:]
        back = subprocess.run([sys.executable, "-c", AUTOMATIONS], env=module_server.env, capture_output=True,
                              text=True, timeout=120)
        assert back.returncode == 0, back.stderr[-3000:]
        found = {a["name"]: a for a in json.loads(back.stdout)}
        triggers = {name: a["trigger"] for name, a in found.items()}
        assert {name: t["expect"] for name, t in triggers.items()} == {
            "nightly-retrain failed": ["prefect.flow-run.Failed"],
            "nightly-retrain crashed": ["prefect.flow-run.Crashed"],
            "nightly-retrain late": ["prefect.flow-run.Late"],
            "nightly-retrain model rejected": ["prefect.flow-run.Rejected"],
            "nightly-retrain no completed night in 26 h": ["prefect.flow-run.*"]}
        quiet = triggers.pop("nightly-retrain no completed night in 26 h")  # no Promoted/Rejected/No new data
        assert (quiet["posture"], quiet["within"], quiet["match"]) == ("Proactive", 26 * 3600,
                                                                       {"prefect.state-type": "COMPLETED"})
        watched = {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"}
        assert quiet["match_related"] == watched
        for t in triggers.values():  # the UI's flow-run-state shape: its card says the tag and the state
            assert (t["posture"], t["match"], t["for_each"], t["match_related"], t["threshold"]) == (
                "Reactive", {"prefect.resource.id": "prefect.flow-run.*"}, ["prefect.resource.id"], watched, 1)
        for a in found.values():
            assert (a["type"], a["block"]) == ("send-notification", block_id)
        nightly = next(d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
                       if d["name"] == "nightly-retrain")
        assert nightly["tags"] == [TAG]

        # Runs end in the states nights end in: the nightly ones failed, crashed or rejected alert, with the run's
        # name, its state's message and its page; a run without the tag and a promoted night do not.
        ended = subprocess.run([sys.executable, "-c", NIGHTS], env=module_server.env, capture_output=True,
                               text=True, timeout=120)
        assert ended.returncode == 0, ended.stderr[-3000:]
        deadline = time.monotonic() + 60
        while len(alerts.bodies) < 3:
            assert time.monotonic() < deadline, alerts.bodies
            time.sleep(0.5)
        time.sleep(2)  # anything more would be alerted by now
        assert sorted(b.strip() for b in alerts.bodies) == [  # this server runs without its UI: no page to link
            "Flow run night-crashed crashed: night-crashed says", "Flow run night-failed failed: night-failed says",
            "Flow run night-rejected: night-rejected says"], alerts.bodies
    finally:
        alerts.close()

"""The retraining run against a real `prefect server start` (SQLite, loopback), read back through the API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from shardflow.synthetic import SynthTable
from storage.synth import synth_dataset

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"}
    proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prefect server did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)
        yield {**env, "PREFECT_API_URL": url}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_run_on_a_real_server_leaves_its_artifacts_there(server, tmp_path):
    synth_dataset(tmp_path / "ds", [SynthTable("item", 300, 1.1)], interactions=5000, seed=5, mean_length=10)
    (tmp_path / "topo.yaml").write_text("intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "dataset": str(tmp_path / "ds"), "run_dir": str(tmp_path / "run"), "topology": str(tmp_path / "topo.yaml"),
        "dim": 8, "mlp": [8], "history": 5, "negatives": 2, "batch_size": 128, "epochs": 1, "eval_users": 100,
    }))
    done = subprocess.run([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml"), "--json"],
                          env=server, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["downloads"] == 1 and summary["epochs"] == 1 and summary["model"] == str(tmp_path / "run" / "model")
    back = subprocess.run([sys.executable, "-c", READ_BACK], env=server, capture_output=True, text=True, timeout=120)
    assert back.returncode == 0, back.stderr[-3000:]
    seen = json.loads(back.stdout)
    assert ["retrain-flexshard-1-epochs", "COMPLETED"] in seen["runs"]
    assert {"profile", "plan-comparison", "training-progress", "retrain-summary"} <= set(seen["artifacts"])


def test_prefect_yaml_deploys_the_nightly_and_the_estimation_deployments(server):
    pool = subprocess.run([str(BIN / "prefect"), "work-pool", "create", "shardflow-process", "--type", "process"],
                          env=server, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert pool.returncode == 0, pool.stderr[-2000:]
    deployed = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env=server,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert deployed.returncode == 0, (deployed.stdout + deployed.stderr)[-3000:]
    back = subprocess.run([sys.executable, "-c", DEPLOYMENTS], env=server, capture_output=True, text=True, timeout=120)
    assert back.returncode == 0, back.stderr[-3000:]
    found = json.loads(back.stdout)
    assert found["nightly-retrain"] == {"cron": ["0 2 * * *"], "limit": 1, "collision": "CANCEL_NEW",
                                        "pool": "shardflow-process"}
    assert found["estimate"]["pool"] == "shardflow-process"

"""The deployments the README's way: a real `prefect server`, `prefect deploy --all` of prefect.yaml, and a
real `prefect worker` of its work pool running them, night after night and when the scheduler says so.

Only this path shows what Prefect does to a deployment run's process (the entrypoint's
folder first on sys.path, inherited by the Dask workers it spawns): every run here goes
through the worker, and its state is read back from the API.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import PrefectServer

from shardflow.config_sections import sectioned
from storage import versions
from support import head_of_log, split_into_days
from tasks.assets import model_key

pytestmark = pytest.mark.server  # the tier: `shardflow run` or `prefect` as processes

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
NIGHT = dict(epochs=1, batch_size=512, dim=8, mlp=[8], history=5, negatives=2, eval_users=500, memory_slack=0.5)
RUN_S = 600  # one deployment run, start-up of its process and cluster included, on a loaded 2-core machine
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

SCHEDULE = """
import asyncio, json, sys
from datetime import datetime, timezone
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.client.schemas.schedules import RRuleSchedule
async def main():
    config, at = json.loads(sys.argv[1]), datetime.fromisoformat(sys.argv[2])
    async with get_client() as c:
        d = await c.read_deployment_by_name("retrain/nightly-retrain")
        await c.update_deployment(d.id, DeploymentUpdate(parameters={"config": config}))
        rule = RRuleSchedule(rrule=f"DTSTART:{at:%Y%m%dT%H%M%S}Z\\nRRULE:FREQ=DAILY;COUNT=1", timezone="UTC")
        await c.create_deployment_schedules(d.id, [(rule, True)])
        print(d.id)
asyncio.run(main())
"""


@pytest.fixture
def deployed(tmp_path):
    """A server (scheduler every 5 s), prefect.yaml deployed from the repository root, and a worker of its pool."""
    server = PrefectServer(tmp_path)
    server.env["PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS"] = "5"
    server.env["PREFECT_WORKER_QUERY_SECONDS"] = "2"
    server.start()
    worker = None
    try:
        for command in (["work-pool", "create", "shardflow-process", "--type", "process"],
                        ["--no-prompt", "deploy", "--all"]):
            done = subprocess.run([str(BIN / "prefect"), *command], env=server.env, cwd=ROOT, capture_output=True,
                                  text=True, timeout=RUN_S)
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "shardflow-process"],
                                  env=server.env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        yield server, tmp_path / "worker.log"
    finally:
        if worker is not None:
            stop_worker(worker, server.url)
        server.stop()


def stop_worker(worker: subprocess.Popen, url: str) -> None:
    """Killed, with every process left that it started (those alone have this server's URL in their
    environment). What is tested has been asserted by then. Prefect's worker stops on SIGTERM only once the
    flow-run processes it started have exited: within 2 s on a quiet machine, but not within 20 s in a
    suite beside a CPU-bound job (2026-11-28), and once not within 60 s on CI."""
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=60)
    marker = f"PREFECT_API_URL={url}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            started_by_worker = marker in environ.read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if started_by_worker and int(environ.parent.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(environ.parent.name), signal.SIGKILL)


def flow_runs(server) -> list[dict]:
    """Every flow run, read back through the API's REST endpoint (what Prefect's client calls)."""
    request = urllib.request.Request(f"{server.url}/flow_runs/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        runs = json.load(answer)
    return [{"id": r["id"], "name": r["name"], "state": r["state_type"], "message": (r["state"] or {}).get("message"),
             "state_name": r["state_name"], "tags": r["tags"], "deployment": r["deployment_id"],
             "auto": r["auto_scheduled"],
             "due": r["expected_start_time"] and datetime.fromisoformat(r["expected_start_time"])} for r in runs]


def events(server, name: str) -> list[dict]:
    """The newest 50 events named `name`, read back through the API's REST endpoint, oldest first."""
    body = json.dumps({"filter": {"event": {"name": [name]}, "order": "DESC"}, "limit": 50}).encode()
    request = urllib.request.Request(f"{server.url}/events/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return list(reversed(json.load(answer)["events"]))


def run_deployment(server, name: str, config: dict | None = None, params: dict | None = None) -> dict:
    """`prefect deployment run NAME --params ... --watch`, as an operator types it; the run as the API has it.
    `params`: the parameters, else {"config": config}."""
    before = {r["id"] for r in flow_runs(server)}
    given = json.dumps({"config": config} if params is None else params)
    deadline = time.monotonic() + RUN_S
    done = subprocess.run([str(BIN / "prefect"), "deployment", "run", name, "--params", given, "--watch"],
                          env=server.env, capture_output=True, text=True, timeout=RUN_S)
    # The server's scheduler adds the nightly 02:00 runs meanwhile: those are not this one.
    new = [r for r in flow_runs(server) if r["id"] not in before and not r["auto"]]
    assert len(new) == 1, (new, done.stdout[-2000:])
    # `--watch` follows the run over the server's event and log websockets and gives up ("Stopped watching flow
    # run ...") when one closes early: once in a CI on a loaded 2-core machine it returned with the run still
    # SCHEDULED, and the next nights met the deployment's limit of one run. The run is read back until final.
    while new[0]["state"] not in FINAL:
        assert time.monotonic() < deadline, (new, (done.stdout + done.stderr)[-2000:])
        time.sleep(1)
        new = [r for r in flow_runs(server) if r["id"] == new[0]["id"]]
    return new[0]


def test_the_deployments_run_through_a_worker_night_after_night_and_on_schedule(deployed, tmp_path):
    server, worker_log = deployed
    log = head_of_log(tmp_path / "Video-head.txt", 40000)
    days = split_into_days(log, tmp_path / "days", (0.6, 0.2, 0.2), late_users=0.1, seed=0)
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    parts, run = tmp_path / "parts", tmp_path / "nightly"
    parts.mkdir()
    # The API takes the same flat keys `shardflow run --set` does (the schema names them beside the sections the
    # UI's form shows); the first night is given them, the later ones the sections.
    flat = {"dataset": str(parts), "run_dir": str(run), "topology": str(tmp_path / "topo.yaml"), **NIGHT}
    config = sectioned(flat)

    nights = []
    for k, day in enumerate(days):  # three nights, each with the day's new part
        shutil.copy2(day, parts)
        nights.append(run_deployment(server, "retrain/nightly-retrain", flat if k == 0 else config))
    text = worker_log.read_text()
    assert [r["state"] for r in nights] == ["COMPLETED"] * 3, (nights, text[-5000:])
    label = nights[0]["name"].split("·")[0]
    assert [r["name"] for r in nights] == [f"{label}·v1", f"{label}·v2", f"{label}·v3"]
    assert nights[0]["message"].startswith("promoted v1 (cold start): AUC ")
    assert all(r["message"].startswith((f"promoted v{v}: AUC ", f"rejected v{v}: AUC "))
               for v, r in zip((2, 3), nights[1:3], strict=True))
    # The runs list tells the nights apart: the state's name and tags say the outcome, the message is short.
    for v, r in zip((1, 2, 3), nights, strict=True):
        verdict = "Promoted" if r["message"].startswith("promoted") else "Rejected"
        assert r["state_name"] == verdict and len(r["message"]) < 70, r
        assert {f"outcome:{verdict.lower()}", f"version:{v}", "shardflow-nightly"} <= set(r["tags"]), r
    assert versions.numbers(run) == [1, 2, 3]
    # Each night's version is an asset of the run_dir, its verdict in its metadata; promotions are events.
    deadline = time.monotonic() + 60
    while len(assets := {e["resource"]["prefect.resource.id"]: e["payload"]
                         for e in events(server, "prefect.asset.materialization.succeeded")}) < 3:
        assert time.monotonic() < deadline, assets
        time.sleep(1)
    assert {k: v["verdict"] for k, v in assets.items()} == {
        model_key(run, v): r["state_name"].lower() for v, r in zip((1, 2, 3), nights, strict=True)}
    promoted = [e["payload"]["version"] for e in events(server, "shardflow.model.promoted")]
    assert promoted == [v for v, r in zip((1, 2, 3), nights, strict=True) if r["state_name"] == "Promoted"], promoted
    made = [versions.started(run, n) for n in (1, 2, 3)]
    promoted_2 = nights[1]["message"].startswith("promoted")  # v3 warm-starts from whichever is current
    assert [m.warm_start_from for m in made] == [None, 1, 2 if promoted_2 else 1]
    assert [len(m.parts) for m in made] == [1, 2, 3]
    # What the worker's log shows of three successful runs: Prefect's lines, none of Dask's, no traceback.
    assert "Traceback" not in text and "distributed." not in text, text[-5000:]

    # The fourth night, with nothing new, is one the scheduler creates (a schedule due in 20 s) and the
    # worker completes. Once the server's scheduler has made it a flow run (every 5 s here), the estimation
    # run runs meanwhile, on another run directory: its load cannot delay the scheduler past the due time.
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=20)
    made = subprocess.run([sys.executable, "-c", SCHEDULE, json.dumps(config), at.isoformat()], env=server.env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    while not [r for r in flow_runs(server) if r["auto"] and r["due"] == at]:
        assert datetime.now(UTC) < at, f"the scheduler made no flow run of the schedule due at {at}"
        time.sleep(0.5)

    estimate = run_deployment(server, "estimate/estimate", {**config, "run_dir": str(tmp_path / "estimate")})
    assert estimate["state"] == "COMPLETED", (estimate, worker_log.read_text()[-5000:])
    assert (tmp_path / "estimate" / "estimate" / "plan" / "manifest.json").is_file()

    deadline, scheduled = time.monotonic() + RUN_S, []
    while time.monotonic() < deadline:
        scheduled = [r for r in flow_runs(server) if r["auto"] and r["name"].endswith("no new data")]
        if scheduled and scheduled[0]["state"] in FINAL:
            break
        time.sleep(2)
    assert scheduled and scheduled[0]["state"] == "COMPLETED", (scheduled, worker_log.read_text()[-5000:])
    current = max(v for v, r in zip((1, 2, 3), nights, strict=True) if r["message"].startswith("promoted"))
    # v3 saw every part, promoted or not; the current version is the last one promoted
    assert scheduled[0]["name"] == f"{label}·no new data", scheduled
    assert scheduled[0]["state_name"] == "No new data" and "outcome:no-new-data" in scheduled[0]["tags"], scheduled
    assert scheduled[0]["message"].startswith(f"no new data since v3: v{current} stays current (AUC "), scheduled
    assert versions.numbers(run) == [1, 2, 3]

    # A refused night (after the scheduled one: the deployment runs one night at a time): FAILED with its one
    # line as the state's message, and no traceback in the worker's log.
    (tmp_path / "foreign" / "versions" / "notes").mkdir(parents=True)
    refused = run_deployment(server, "retrain/nightly-retrain", {**config, "run_dir": str(tmp_path / "foreign")})
    text = worker_log.read_text()
    assert refused["state"] == "FAILED" and "holds notes, not model versions" in refused["message"], refused
    assert refused["name"].endswith("·failed") and {"outcome:failed", "shardflow-nightly"} <= set(refused["tags"])
    assert "Traceback" not in text and "distributed." not in text, text[-5000:]

    # The rollback deployment: version 1 serves again, an event says who and why, the run names its run_dir.
    back = run_deployment(server, "promote/rollback", params={"run_dir": str(run), "version": 1, "reason": "a test"})
    assert back["state"] == "COMPLETED" and back["name"] == f"{label}·promote-v1", back
    assert back["state_name"] == "Rolled back" and back["message"].startswith(f"v1 current (was v{current}) by "), back
    assert {"version:1", "outcome:rolled-back"} <= set(back["tags"]) and versions.current(run) == 1
    deadline = time.monotonic() + 60
    while not (rolled := events(server, "shardflow.model.rolled-back")):
        assert time.monotonic() < deadline
        time.sleep(1)
    assert [(e["payload"]["version"], e["payload"]["previous"], e["payload"]["reason"]) for e in rolled] == [
        (1, current, "a test")], rolled
    assert {"prefect.resource.id": model_key(run, 1), "prefect.resource.role": "asset"} in rolled[0]["related"]

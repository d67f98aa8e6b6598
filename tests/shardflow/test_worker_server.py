"""`shardflow run` starts the server local workers are forked from before its embedded API, so that the server's
imports overlap the API's start (shardflow.cluster.start_worker_server): the workers a local cluster then starts
are forked from that server, with the environment the nanny would have given it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster  # the tier: a process that starts a local cluster

SCRIPT = """
import json, os
from multiprocessing import forkserver
from shardflow.cluster import dask_client, start_worker_server

before = dict(os.environ)
start_worker_server()
after = dict(os.environ)
server = forkserver._forkserver._forkserver_pid
with dask_client(workers=2) as client:
    workers = client.run(lambda: (os.getppid(), __import__("torch").get_num_threads()))
    # Read once workers were forked from it: until the server has exec'd, /proc shows its parent's environment.
    with open(f"/proc/{server}/environ", "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\\0") if b"=" in e)
print(json.dumps({"unchanged": before == after, "server": server, "workers": list(workers.values()),
                  "env": {k.decode(): env.get(k, b"").decode()
                          for k in (b"OMP_NUM_THREADS", b"PYTHONHASHSEED", b"MALLOC_TRIM_THRESHOLD_")}}))
"""


def test_local_workers_fork_from_the_server_started_early_which_has_the_nannys_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONHASHSEED")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["unchanged"]  # the caller's own environment is as it was
    # What distributed's nanny sets before it starts a worker process, less the malloc setting we drop.
    assert found["env"] == {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "6640", "MALLOC_TRIM_THRESHOLD_": ""}
    assert found["workers"] == [[found["server"], 1], [found["server"], 1]]  # forked from it, one thread each

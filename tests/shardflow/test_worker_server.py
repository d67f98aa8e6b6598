"""`shardflow run` starts the server local workers are forked from before its embedded API, so that the server's
imports overlap the API's start (shardflow.cluster.start_worker_server): the workers a local cluster then starts
are forked from that server, with the environment the nanny would have given it."""

from __future__ import annotations

import json
import os
import signal
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
    """The caller's MALLOC_TRIM_THRESHOLD_ is the one a nanny of Dask's own config writes into the process that
    started it: left out all the same."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONHASHSEED")}
    env["MALLOC_TRIM_THRESHOLD_"] = "65536"
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["unchanged"]  # the caller's own environment is as it was
    # What distributed's nanny sets before it starts a worker process, less the malloc setting we drop.
    assert found["env"] == {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "6640", "MALLOC_TRIM_THRESHOLD_": ""}
    assert found["workers"] == [[found["server"], 1], [found["server"], 1]]  # forked from it, one thread each



CTRL_C_AT_START = """
import json, os, signal, sys, threading, time
from multiprocessing import forkserver, util
from shardflow.cluster import start_worker_server

got = []
signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
threading.Thread(target=threading.Event().wait, daemon=True).start()  # a thread the kernel may hand SIGINT to
spawn = util.spawnv_passfds

def spawn_then_ctrl_c(*args):  # multiprocessing's resource tracker, then the worker server
    pid = spawn(*args)
    os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group as the process starts
    return pid

util.spawnv_passfds = spawn_then_ctrl_c
start_worker_server()
server = forkserver._forkserver._forkserver_pid

def masks():
    with open(f"/proc/{server}/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigBlk", "SigIgn", "SigCgt")}

time.sleep(0.5)
os.killpg(0, signal.SIGINT)  # and again while the server imports PyTorch
deadline = time.monotonic() + 300
while not masks()["SigCgt"] & (1 << (signal.SIGCHLD - 1)):  # the server catches SIGCHLD once its imports are done
    assert os.waitpid(server, os.WNOHANG) == (0, 0), "the worker server died"
    assert time.monotonic() < deadline, "the worker server still imports after 300 s"
print(json.dumps({"got": got, "masks": masks()}))
"""


def test_a_ctrl_c_while_the_worker_server_starts_reaches_this_process_and_the_server_ignores_it():
    """The server was spawned with SIGINT ignored here: a Ctrl-C meanwhile was handed to another thread, which
    ignored it, and the run went on to its end. Blocked instead, it must stay blocked until the server ignores it
    (multiprocessing's resource tracker, started on the way, unblocks it: the server then died of it)."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_AT_START], capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["got"] == [signal.SIGINT] * 3, found  # each Ctrl-C reached this process's handler
    sigint = 1 << (signal.SIGINT - 1)
    assert found["masks"]["SigIgn"] & sigint and not found["masks"]["SigBlk"] & sigint, found["masks"]


SERVER_ENDS = """
import atexit, sys
import shardflow.worker_server


class Torn:
    def __del__(self):
        print("torn down", file=sys.stderr)


kept = Torn()  # a module's global: deleted by the interpreter's teardown only
atexit.register(lambda: print("handlers ran", file=sys.stderr, flush=True))
raise SystemExit  # as multiprocessing.forkserver's server ends once the process that started it is gone
"""


def test_the_worker_server_ends_after_its_exit_handlers_without_the_interpreters_teardown():
    done = subprocess.run([sys.executable, "-c", SERVER_ENDS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "handlers ran\n", done

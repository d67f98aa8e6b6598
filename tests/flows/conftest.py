"""A real `prefect server start` (SQLite, loopback) that a test can stop and start again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli.embedded_api import STARTUP_TIMEOUT_S, free_port
from runs import prefect_home

BIN = Path(sys.executable).parent


class PrefectServer:
    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(prefect_home(home / "prefect", STARTUP_TIMEOUT_S)),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_UI_ENABLED": "false", "PREFECT_API_URL": self.url}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"}
        self.proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                      str(self.port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S  # as the embedded API gets: a busy machine needs minutes
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    stderr = self.proc.stderr.read().decode()[-2000:]
                    raise RuntimeError(f"prefect server did not start: {stderr}") from None
                time.sleep(0.5)

    def kill(self) -> None:
        """Gone at once, as a crashed or unreachable server is: connections are refused."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path):
    """A server of the test's own: one it may stop, start again, or fill with runs another test would see."""
    s = PrefectServer(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One server for a module's tests that only add to it (each its own run directory, deployments or
    automations) and assert only on what they added: a server's start-up (4-15 s, more under load) per module."""
    s = PrefectServer(tmp_path_factory.mktemp("server"))
    s.start()
    try:
        yield s
    finally:
        s.stop()

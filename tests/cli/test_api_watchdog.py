"""The embedded API's watchdog (cli/embedded_api.py) on a stand-in server process: what it starts again outlives it."""

from __future__ import annotations

import subprocess
import sys
import time

from cli.embedded_api import _Watchdog, spawn

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


class StandInServer:
    """The parts of cli.embedded_api.EmbeddedServer the watchdog uses; its process sleeps instead of serving. It
    starts that process as the embedded server does (`spawn`: its own session, the parent-death signal)."""

    address = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.server_process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: int, output=None) -> None:
        self.server_process = spawn(SLEEPER, output=output)
        self.starts += 1


def test_a_server_started_again_outlives_the_watchdog_until_the_process_exits():
    server = StandInServer()
    server.start(timeout=1)
    first = server.server_process
    watchdog = _Watchdog(server, timeout_s=5)
    try:
        first.kill()
        deadline = time.monotonic() + 30
        while server.starts < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.starts == 2, "the watchdog did not start the server again within 30 s"
        watchdog.stop()
        time.sleep(1)  # the parent-death signal, had the thread that started it ended, arrives at once
        assert server.server_process.poll() is None, "the server started again was stopped with the watchdog"
        assert watchdog.is_alive()
    finally:
        server.server_process.kill()
        server.server_process.wait()

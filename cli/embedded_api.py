"""The Prefect API a `shardflow run` talks to, and how a run ends when it is interrupted.

Without PREFECT_API_URL, Prefect starts a temporary server (uvicorn) as a child process on
the first API call. Started that way it sits in the terminal's process group: Ctrl-C
reaches it first, and the run then spends minutes retrying a dead API before it can
record that it was interrupted; a SIGTERM to the run leaves it running, re-parented.
`embedded_api` starts that same server (`EmbeddedServer`: Prefect's command and
environment, without importing Prefect's server package here) up front, in a session of
its own (a terminal's signals never reach it) that dies with the run's process (the
parent-death signal, on Linux), and stops it at exit, once Prefect's log and event
workers have sent what they hold.

Prefect gives that server PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS to answer, 20 s
by default: at load 10-15 on 2 cores it needed 120-300 s. Unless that variable is set, a
run gives it STARTUP_TIMEOUT_S; a server that does not answer in time ends the run with
one line naming the setting (a TrainingError: exit status 3).

If that server dies while the run goes on (killed, out of memory), the run starts it again
on the same address and database (`_Watchdog`): Prefect's client retries its calls for
about a minute, so the flow, its task runs and its training go on, and the terminal gets
one warning line. A server that cannot be started again stops the run at once with one
line and exit status 3: nothing can be recorded without it, every store is written by a
rename, and the same command resumes from the last checkpoint.

The command's SIGTERM handler (cli.main) raises an exception, so a terminated run ends the
way Ctrl-C ends it: Prefect records the flow run as Crashed, the cluster and the
parameter servers are released on the way out, and the checkpoints are kept.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

from shardflow.errors import TrainingError

PR_SET_PDEATHSIG = 1  # prctl(2)
STARTUP_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = 600  # the embedded API's start-up time unless STARTUP_SETTING is set


def startup_timeout_s() -> int:
    """How long the embedded API may take to start: STARTUP_SETTING if set, else STARTUP_TIMEOUT_S."""
    text = os.environ.get(STARTUP_SETTING, "").strip()
    if not text:
        return STARTUP_TIMEOUT_S
    if not text.isdigit() or int(text) < 1:
        from shardflow.errors import InputError

        raise InputError(f"{STARTUP_SETTING}={text!r}; accepted: whole seconds >= 1 (default {STARTUP_TIMEOUT_S})")
    return int(text)


def _die_with_parent() -> None:
    """In the server's child process, before exec: SIGTERM it when the process that started it exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError):  # not Linux: the server is stopped at exit only
        pass


def spawn(argv: list[str], env: dict[str, str] | None = None, output=None) -> subprocess.Popen:
    """A server process in a session of its own (a terminal's signals never reach it) that gets SIGTERM
    when the thread that started it ends; its output into `output` (a file) if given."""
    streams = {} if output is None else {"stdout": output, "stderr": subprocess.STDOUT}
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent, **streams)


class ServerExited(RuntimeError):
    """The server's process exited before it answered."""


class EmbeddedServer:
    """Prefect's API app served by uvicorn on 127.0.0.1:`port`: the command and environment Prefect's own
    temporary server has (prefect.server.api.server.SubprocessASGIServer), started from here so that
    this process never imports Prefect's server package (1.9 s of every run's start-up, measured)."""

    HEALTH_POLL_S = 0.1

    def __init__(self, port: int) -> None:
        self.port = port
        self.server_process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.address}/api"

    def start(self, timeout: int, output=None, meanwhile: Callable[[], object] | None = None) -> None:
        """Start the server and wait until it answers; TimeoutError after `timeout` s, ServerExited if its
        process ends first. `meanwhile` runs once the server's process is started, before the wait: work of
        this process that overlaps the server's start-up (its timeout counts from the start)."""
        import prefect
        from prefect.settings import get_current_settings

        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **get_current_settings().to_environment_variables(exclude_unset=True)}
        env.pop("PREFECT_API_URL", None)  # this process's, naming the server itself
        logging.getLogger("prefect").info("Starting temporary server on %s", self.address)
        self.server_process = spawn([sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                                     "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                                     "--port", str(self.port), "--log-level", "error", "--lifespan", "on"], env, output)
        deadline = time.monotonic() + timeout
        if meanwhile is not None:
            meanwhile()
        while not self._healthy():
            if self.server_process.poll() is not None:
                raise ServerExited(f"its process exited with status {self.server_process.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout} s")
            time.sleep(self.HEALTH_POLL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        process, self.server_process = self.server_process, None
        if process is None or process.poll() is not None:
            return
        logging.getLogger("prefect").info("Stopping temporary server on %s", self.address)
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def embedded_api(meanwhile: Callable[[], object] = lambda: None) -> Iterator[str | None]:
    """Yield the API URL this process uses: PREFECT_API_URL if set, else that of a temporary server started here.
    `meanwhile` runs before the yield, while that server starts up.

    The process's Prefect settings then name that server: the main thread's, and the environment, from
    which a thread without a settings context builds its own. It is stopped at exit, after Prefect's
    log and event workers have sent what they hold (they drain at threading's shutdown, which comes
    before any atexit callback)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        meanwhile()
        yield PREFECT_API_URL.value()
        return
    timeout_s = startup_timeout_s()
    server = EmbeddedServer(free_port())
    atexit.register(server.stop)
    # What the server says goes to a file of its own, not the terminal: killed with the run (kill -9 of the
    # group), it is stopped by the parent-death signal and uvicorn prints its cancelled requests' tracebacks.
    output = tempfile.TemporaryFile()  # nameless: gone with the last process that has it open
    try:
        server.start(timeout_s, output, meanwhile=meanwhile)
    except TimeoutError:
        server.stop()
        raise TrainingError(
            f"the embedded Prefect API did not answer within {timeout_s} s ({STARTUP_SETTING}){_last_error(output)}; "
            "nothing was written. A busy machine needs more: set it higher, or point PREFECT_API_URL at a running "
            "server"
        ) from None
    except ServerExited as e:
        raise TrainingError(f"the embedded Prefect API did not start: {e}{_last_error(output)}; nothing was "
                            "written") from None
    os.environ["PREFECT_API_URL"] = server.api_url
    watchdog = _Watchdog(server, timeout_s)
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        watchdog.stop()


class _Watchdog(threading.Thread):
    """Starts the embedded API again, on its address and database, when its process dies during the run.

    The parent-death signal follows the thread that started the server, not the process (prctl(2)): a
    server this thread started again would be stopped the moment the thread ended, before Prefect's log
    and event workers sent what they hold at exit. So once it has started one, this thread stays parked
    after `stop` and ends with the process."""

    POLL_S = 0.5

    def __init__(self, server, timeout_s: int) -> None:
        super().__init__(name="shardflow-api-watchdog", daemon=True)
        self.server, self.timeout_s = server, timeout_s
        self.stopping, self.watched = threading.Event(), threading.Event()
        self.restarted = False
        self.start()

    def stop(self) -> None:
        self.stopping.set()
        self.watched.wait(timeout=5)

    def run(self) -> None:
        try:
            self._watch()
        finally:
            self.watched.set()
        if self.restarted:
            threading.Event().wait()  # never set: the server started here lives as long as the process

    def _watch(self) -> None:
        log = logging.getLogger("shardflow")
        while not self.stopping.wait(self.POLL_S):
            process = self.server.server_process
            if process is None or process.poll() is None:
                continue
            status = process.returncode
            log.warning("the embedded Prefect API stopped (exit status %s); starting it again at %s, the run goes "
                        "on", status, self.server.address)
            with tempfile.TemporaryFile() as output:  # what the server says while it tries: for the one line
                try:
                    self.server.start(self.timeout_s, output)
                except Exception as e:  # noqa: BLE001 (whatever stopped it: the run cannot go on without an API)
                    if not self.stopping.is_set():
                        self._stop_run(f"the embedded Prefect API stopped (exit status {status}) and did not start "
                                       f"again ({_first_line(e)}{_last_error(output)})")
                    return
            self.restarted = True

    @staticmethod
    def _stop_run(why: str) -> None:
        """End the process now: every call the run would still make (its state, its logs) would retry a dead
        server for minutes. Its local Dask workers exit with it (they watch their parent)."""
        os.write(2, f"shardflow run: training stopped: {why}; every complete checkpoint and store is kept: run "
                    "the same command again to resume\n".encode())
        os._exit(3)


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


def _last_error(output) -> str:
    """The server's last line that names an error (a port in use, say), after a semicolon; "" if none."""
    output.seek(0)
    lines = [line for line in output.read().decode(errors="replace").splitlines() if "rror" in line]
    return f"; the server said: {lines[-1].strip()[:200]}" if lines else ""

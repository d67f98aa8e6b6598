"""The Prefect API a `shardflow run` talks to, and how a run ends when it is interrupted.

Without PREFECT_API_URL, Prefect starts a temporary server (uvicorn) as a child process on
the first API call. Started that way it sits in the terminal's process group: Ctrl-C
reaches it first, and the run then spends minutes retrying a dead API before it can
record that it was interrupted; a SIGTERM to the run leaves it running, re-parented.
`embedded_api` starts that same server up front in a session of its own (a terminal's
signals never reach it) that dies with the run's process (the parent-death signal, on
Linux); Prefect stops it at exit, once its log and event workers have sent what they hold.

Prefect gives that server PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS to answer, 20 s
by default: at load 10-15 on 2 cores it needed 120-300 s. Unless that variable is set, a
run gives it STARTUP_TIMEOUT_S; a server that does not answer in time ends the run with
one line naming the setting (a TrainingError: exit status 3).

`terminated_as_interrupt` turns SIGTERM into an exception, so a terminated run ends the
way Ctrl-C ends it: Prefect records the flow run as Crashed, the cluster and the
parameter servers are released on the way out, and the checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Iterator

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


class Terminated(BaseException):
    """The run's process was sent SIGTERM (a BaseException: like KeyboardInterrupt, no handler swallows it)."""


def _die_with_parent() -> None:
    """In the server's child process, before exec: SIGTERM it when the process that started it exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError):  # not Linux: the server is stopped at exit only
        pass


class _OwnSession:
    """`subprocess` as Prefect's server module sees it while it starts the server: its own session."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args, **kwargs):  # noqa: N802 (subprocess's name)
        return subprocess.Popen(*args, start_new_session=True, preexec_fn=_die_with_parent, **kwargs)


@contextlib.contextmanager
def embedded_api() -> Iterator[str | None]:
    """Yield the API URL this process uses: PREFECT_API_URL if set, else a temporary server started here."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    import prefect.server.api.server as api_server

    timeout_s = startup_timeout_s()
    server = api_server.SubprocessASGIServer()  # the instance Prefect's clients use without PREFECT_API_URL
    api_server.subprocess = _OwnSession()
    try:
        server.start(timeout=timeout_s)  # registers its own stop at exit, after Prefect's log and event workers drained
    except RuntimeError as e:
        if "Timed out" not in str(e):
            raise
        server.stop()
        raise TrainingError(
            f"the embedded Prefect API did not answer within {timeout_s} s ({STARTUP_SETTING}); nothing was "
            "written. A busy machine needs more: set it higher, or point PREFECT_API_URL at a running server"
        ) from None
    finally:
        api_server.subprocess = subprocess
    yield server.api_url


@contextlib.contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    def stop(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


"""The `shardflow` command: one subcommand per stage (cli/arguments.py; what each does: cli/commands.py).

Each subcommand prints a human-readable summary, or with --json a single JSON object
on stdout. Logs go to stderr. Bad input exits with status 2 and one line naming the
bad value and what is accepted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence

from cli import end_at_exit
from cli.arguments import build_parser
from shardflow.errors import (
    STORAGE_ERRNOS,
    InputError,
    Terminated,
    TrainingError,
    WorkerLost,
    explained,
    note_stop,
    stop_signal,
)

_KEPT = "every complete checkpoint and store is kept: run the same command again to resume"


class _Interrupts:
    """Ctrl-C raises KeyboardInterrupt, as ever, and SIGTERM Terminated, and the command winds down (its
    cluster, its API server) to say so in one line. A second stop signal, either one, ends the process at once:
    with that line if it was not said yet, silently if it was. Raised again into the winding down, it could land
    inside a lock's own bookkeeping (threading.Condition) and leave the lock held: `shardflow train` sent SIGTERM
    twice (by `timeout` and by `pkill`) waited in Dask's Client.close for good. Every store is written by a
    rename, so stopping anywhere keeps what is complete. During a flow run Prefect puts its own SIGTERM handler
    in and, once its flow run is recorded as Crashed, puts this one back and sends the signal again: the first
    this handler sees.

    A handler's exception can be lost: raised while a finalizer runs (Python prints "Exception ignored" and goes
    on) or inside a library's callback that logs and goes on. So every stop signal is also noted as it arrives,
    by a thread reading the interpreter's signal wake-up pipe (whichever handler is in, Prefect's included),
    and the run's next training step or stage raises it again (shardflow.errors.stop_if_asked).
    """

    def __init__(self, command: str) -> None:
        self.command, self.said, self.stopping = command, False, False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._first)
            signal.signal(signal.SIGTERM, self._terminated)
            wake, self._woken = os.pipe()
            os.set_blocking(self._woken, False)
            signal.set_wakeup_fd(self._woken, warn_on_full_buffer=False)
            threading.Thread(target=self._note, args=(wake,), name="shardflow-signals", daemon=True).start()
            sys.unraisablehook = self._unraisable
        # Stopped at once, the process leaves its local workers' semaphores to multiprocessing's resource
        # tracker, which removes them and warns once per process on the terminal; it takes its warning
        # filters from these options when it starts.
        sys.warnoptions.append("ignore:resource_tracker:UserWarning")

    def _first(self, signum, frame) -> None:
        self._at_once_from_now(signum, frame)
        raise KeyboardInterrupt

    def _terminated(self, signum, frame) -> None:
        self._at_once_from_now(signum, frame)
        raise Terminated(f"signal {signum}")

    def _at_once_from_now(self, signum, frame) -> None:
        """The first stop: noted, and the next one ends the process (also if Prefect, leaving a flow run, put
        this handler back over `_again`)."""
        if self.stopping:
            self._again(signum, frame)
        self.stopping = True
        signal.signal(signal.SIGINT, self._again)
        signal.signal(signal.SIGTERM, self._again)
        note_stop(signum)

    @staticmethod
    def _note(wake: int) -> None:
        while True:
            for signum in os.read(wake, 64):
                note_stop(signum)

    @staticmethod
    def _unraisable(unraisable) -> None:
        """Python's "Exception ignored in" report, except what a stop signal caused: the stop's own exception
        lost in a finalizer (taken up again later), and once a stop has arrived, any finalizer's error (an
        object the stop cut short in its constructor fails in its finalizer: asyncio's event loop, made by
        zarr as a SIGTERM landed, lacked `_ssock`). Their tracebacks are not for the terminal."""
        error = unraisable.exc_value
        if error is None or (isinstance(error, Exception) and stop_signal(error) is None):
            sys.__unraisablehook__(unraisable)

    def _again(self, signum, frame) -> None:
        if not self.said:
            how = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
            os.write(2, f"shardflow {self.command}: {how} twice, stopped at once; {_KEPT}\n".encode())
        os._exit(128 + signum)

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.said = True


class _Terminal(logging.Formatter):
    """Log lines for the terminal: an error shardflow explains in one line (bad input, a run that stopped,
    an interrupt, a file system that refuses writes) is logged without its traceback, which the Prefect
    API's log (the UI) keeps."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and explained(record.exc_info[1], record.name):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(_Terminal("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[terminal])
    interrupts = _Interrupts(args.command)
    try:
        summary = args.run(args)
    except BaseException as e:
        status = _ended(args.command, interrupts, e)
        if status is None:
            raise
        return status
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        args.show(summary)
    return 0


def _ended(command: str, interrupts: _Interrupts, e: BaseException) -> int | None:
    """The exit status of a command that raised `e`, once its one line is said; None if `e` is no error
    shardflow explains (its traceback is the message). Whatever is raised once a stop signal has arrived is
    that stop: Ctrl-C landing inside a library's call can come out as the library's own error (pydantic's
    serializer reports a KeyboardInterrupt as a PydanticSerializationError)."""
    stop = stop_signal(e)
    if stop is not None:
        # What the stop cut short may leave a coroutine never awaited (zarr's, made as the signal landed): the
        # warning Python prints when it is collected, on the way out, is not for the terminal.
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    if stop == signal.SIGTERM:
        interrupts.say(f"shardflow {command}: terminated (SIGTERM); {_KEPT}")
        return 143
    if stop == signal.SIGINT:
        interrupts.say(f"shardflow {command}: interrupted; {_KEPT}")
        return 130
    if isinstance(e, InputError):
        print(f"shardflow {command}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, TrainingError):
        print(f"shardflow {command}: training stopped: {e}", file=sys.stderr)
        return 3
    if isinstance(e, WorkerLost):  # a run restores from its last checkpoint first; `train` keeps none
        then = (_KEPT if command == "run" else "`shardflow train` keeps no checkpoints: run it again on a whole "
                "cluster, or use `shardflow run`, which restores the last one")
        print(f"shardflow {command}: training stopped: {e}; {then}", file=sys.stderr)
        return 3
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
        print(f"shardflow {command}: stopped: {e}; {_KEPT} once the file system accepts writes again",
              file=sys.stderr)
        return 4
    return None


def command() -> int:
    """The `shardflow` command (pyproject's script): `main` on this process's arguments; an exit status it gives
    ends the process once every exit handler has run, without the interpreter's teardown (cli.end_at_exit)."""
    status = main()
    end_at_exit(status)
    return status


if __name__ == "__main__":
    sys.exit(command())

"""shardflow's exceptions: bad input, and the ends of a training run.

Every InputError message names the offending value (file, array, line or position) and
what would have been accepted, so a user can fix the input without reading
code. Raised before any work that writes to a store starts.

`explained` says which errors a log shows as their one line: shardflow's own, an interrupt,
a file system that refuses writes, a Dask connection closing; their tracebacks are noise
to an operator (the Prefect API's log keeps them for the UI).
"""

import errno
import logging
import reprlib
import signal

# A full disk, a quota, a read-only or forbidden directory: the writes stop, nothing stored is lost.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


class InputError(ValueError):
    """Input that shardflow refuses: a file, an array, an argument or a store."""


def brief(value: object, width: int = 80) -> str:
    """`value`'s repr for a one-line message: nesting past 3 levels and long strings elided, at most `width`
    characters (a value nested thousands deep is shown, not recursed into)."""
    r = reprlib.Repr()  # Python 3.11: no keyword arguments yet
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxtuple = 3, width, width, 6, 6, 6
    text = r.repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def first_line(error: BaseException, width: int = 120) -> str:
    """`error` as `Type: its message's first line`, at most `width` characters of the message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:width]}"


class DamagedStore(InputError):
    """A stored array no longer matches the digest written with it (or cannot be read): `file` names it,
    `segment` the dataset segment it belongs to (None outside a dataset)."""

    def __init__(self, message: str, file: str, segment: int | None = None) -> None:
        super().__init__(message)
        self.file, self.segment = file, segment


class OtherFormat(InputError):
    """A source line one format refuses that reads as `other`, another format: a caller names its own key for it."""

    def __init__(self, message: str, other: str) -> None:
        super().__init__(message)
        self.other = other

    def __reduce__(self):  # pickled as it was made, with `other`: an exception may cross from a Dask worker
        return type(self), (str(self), self.other)


class Terminated(BaseException):
    """The process was sent SIGTERM (a BaseException: like KeyboardInterrupt, no handler swallows it)."""


_asked: list[int] = []  # the stop signals this process was sent (the command's signal watcher appends)


def note_stop(signum: int) -> None:
    """Remember that the process was sent SIGINT or SIGTERM, whatever its handler did with it."""
    if signum in (signal.SIGINT, signal.SIGTERM):
        _asked.append(signum)


def _asked_signal() -> int | None:
    """The stop signal this process was sent (SIGTERM before SIGINT), or None."""
    return (signal.SIGTERM if signal.SIGTERM in _asked else _asked[0]) if _asked else None


def _stop_exception(signum: int) -> BaseException:
    """What a stop signal raises: Terminated for SIGTERM, KeyboardInterrupt for SIGINT."""
    return Terminated(f"signal {signal.SIGTERM.value}") if signum == signal.SIGTERM else KeyboardInterrupt()


def stop_if_asked() -> None:
    """Raise the stop a signal asked for (Terminated or KeyboardInterrupt), if one was sent: called before new
    work starts (a training step, a run's next stage). A handler's exception raised inside a finalizer or a
    callback that logs and goes on is lost; this takes the stop up again at the next such point."""
    asked = _asked_signal()
    if asked is not None:
        raise _stop_exception(asked)


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient, a cluster that cannot be restored): says what
    and where."""


class WorkerLost(RuntimeError):
    """A Dask worker holding a device's parameter shard left the cluster; its shard is gone.

    Recoverable: the run restores the cluster and every shard from the last complete checkpoint.
    """


class WorkerOutOfMemory(WorkerLost):
    """A worker was lost when it had last been seen near its memory limit: probably stopped for memory.

    Restoring from a checkpoint may succeed once (a spike); a start-up that ran out of memory
    would only run out again, so the run stops instead of retrying it.
    """


class SchedulerLost(TrainingError):
    """The Dask scheduler went away: no cluster is left to restore, so the run stops (its checkpoints stay)."""


def interrupted(error: BaseException | None) -> bool:
    """Whether `error` was raised while a Ctrl-C was being handled: Prefect's task engine can fail on
    its own (ValueError 'Task run is not set') when the interrupt lands while a task run begins."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def stop_signal(error: BaseException) -> int | None:
    """The stop signal `error` comes of: SIGTERM for a Terminated, SIGINT for an interrupt (interrupted), else
    the stop signal this process was sent (note_stop) if any: what is raised once one arrived is that stop."""
    if isinstance(error, Terminated):
        return signal.SIGTERM
    if interrupted(error):
        return signal.SIGINT
    return _asked_signal()


def as_stop(error: BaseException) -> BaseException | None:
    """The stop `error` comes of (stop_signal) as the exception that stop raises, or None: raised from `error`,
    Prefect records a Crashed run where the error itself (its task engine's ValueError 'Task run is not set'
    when a Ctrl-C lands as a task begins) would be recorded Failed."""
    stop = stop_signal(error)
    if stop is None or isinstance(error, (Terminated, KeyboardInterrupt)):
        return None
    return _stop_exception(stop)


def explained(error: BaseException | None, logger: str = "") -> bool:
    """Whether a log line about `error` says all there is in its message (no traceback wanted)."""
    if error is None:
        return False
    if isinstance(error, (InputError, TrainingError, WorkerLost, KeyboardInterrupt)):
        return True
    if isinstance(error, OSError) and (error.errno in STORAGE_ERRNOS or logger.startswith("distributed")):
        return True
    return isinstance(error, Terminated) or interrupted(error)


class OneLine(logging.Filter):
    """A handler filter: an explained error's record loses its traceback (its message stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and explained(record.exc_info[1], record.name):
            record.exc_info, record.exc_text = None, None
        return True


def one_line_errors() -> None:
    """Put OneLine on the stream handlers of the root and `prefect` loggers: Prefect's console (a terminal, or
    the log of the worker that started the flow run) hangs on the root logger."""
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not any(isinstance(f, OneLine) for f in handler.filters):
                handler.addFilter(OneLine())

"""The shardflow command line: each subcommand parses its flags and calls a stage, a task or a flow.

A command ends without tearing its interpreter down (`end_at_exit`): Python's teardown of what a run
imports (PyTorch, Prefect, Dask) took 1.0-1.2 s of CPU after the command's work was done and said, and
nothing in it is written. The exit handlers all run first: threads joined, Prefect's logs and events sent,
logging's handlers flushed and closed, temporary directories removed, the embedded API stopped.
"""

import atexit
import os
import sys

_status: list[int] = []  # the exit status end_at_exit was given


def end_at_exit(status: int) -> None:
    """End this process with `status` once every other exit handler has run, skipping the interpreter's
    teardown. Only the command itself calls it (cli.main.command), never code that imports cli."""
    _status.append(status)


def _end() -> None:
    if not _status:
        return
    for stream in {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__} - {None}:
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (a closed pipe), or the stream closed: nothing to flush to
            pass
    os._exit(_status[-1])


# Registered when `cli` is first imported, before any library registers its own: exit handlers run last in,
# first out, so this one runs after all of them.
atexit.register(_end)

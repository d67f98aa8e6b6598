"""Imported first by the local workers' fork server (shardflow.cluster.WORKER_PRELOAD), and by nothing else:
from here on it and every worker it forks ignore SIGINT, and the server ends without tearing its interpreter
down.

The server starts with SIGINT blocked (shardflow.cluster.start_worker_server): a terminal's Ctrl-C that
reaches the whole process group while the interpreter starts waits, and ignoring the signal discards it; the
server's imports that follow (PyTorch, seconds) cannot die of it printing a KeyboardInterrupt traceback. Then
SIGINT is unblocked: a blocked mask would pass to whatever the workers start.

The server ends when the process that started it does. Python's teardown of what it imported (PyTorch, Dask,
the engine) then took 1.0 s of CPU, and a command's caller reading its output waited for it: the server holds
the command's stdout and stderr. It writes nothing and holds nothing to close, so its last exit handler (the
first registered: they run last in, first out) ends it at once. Its workers never run it: a forked worker
ends with os._exit (multiprocessing.forkserver).
"""

import atexit
import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
atexit.register(os._exit, 0)

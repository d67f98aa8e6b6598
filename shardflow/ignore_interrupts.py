"""Imported first by the local workers' fork server (shardflow.cluster.WORKER_PRELOAD): from here on it and
every worker it forks ignore SIGINT.

The server starts with SIGINT blocked (shardflow.cluster.start_worker_server): a terminal's Ctrl-C that
reaches the whole process group while the interpreter starts waits, and ignoring the signal discards it; the
server's imports that follow (PyTorch, seconds) cannot die of it printing a KeyboardInterrupt traceback. Then
SIGINT is unblocked: a blocked mask would pass to whatever the workers start.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

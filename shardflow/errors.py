"""shardflow's exceptions: bad input, and the ends of a training run.

Every InputError message names the offending value (file, array, line or position) and
what would have been accepted, so a user can fix the input without reading
code. Raised before any work that writes to a store starts.
"""


class InputError(ValueError):
    """Input that shardflow refuses: a file, an array, an argument or a store."""


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

"""An operator's rollback as a deployment: make a finished model version of a run_dir current.

The same as `shardflow promote RUN_DIR --version N --reason TEXT`: it holds the run_dir's
lock (never under a running night), checks the version's export, switches `current`
atomically and records who, when and why in RUN_DIR/promotions.json. The next night
warm-starts from it and never re-promotes a version made before it.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.states import Completed

from shardflow.errors import one_line_errors
from shardflow.records import plain
from shardflow.reporting.run_report import run_label
from storage import versions
from tasks.reports import announce_rollback, tag_run


def _run_name() -> str:
    """`<run_dir label>·promote-vN`: which run_dir's rollback, to which version, in the runs list."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"{run_label(p.get('run_dir', '?'))}·promote-v{p.get('version', '?')}"


@flow(name="promote", flow_run_name=_run_name)
def promote_version(run_dir: str, version: int, reason: str = "rollback"):
    """The run ends in a state named `Rolled back` whose message says which version serves now, and which did."""
    one_line_errors()
    record = versions.rollback(run_dir, version, reason)
    get_run_logger().info("version %d of %s is current (was %s): %s", version, run_dir, record.previous, reason)
    announce_rollback(run_dir, record)
    tag_run([f"version:{version}", "outcome:rolled-back"])
    was = "none" if record.previous is None else f"v{record.previous}"
    return Completed(name="Rolled back", message=f"v{version} current (was {was}) by {record.by}"[:70],
                     data=plain(record))

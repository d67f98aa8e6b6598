"""Build an emulated cluster from a topology file, run one command in it, and remove everything it made.

    python -m shardflow.emulation TOPOLOGY [--time-scale auto|N] [--logs DIR] [--probe] [-- COMMAND ...]

COMMAND runs in the hub namespace, where the scheduler is; `{scheduler}` in it becomes the
scheduler's address, e.g.

    python -m shardflow.emulation topologies/two-nodes-uneven.yaml -- \\
        shardflow train DATA --plan PLAN --scheduler {scheduler}

With --time-scale auto (the default) it first times a reference step on this host and prints
the factor it chose (shardflow.emulation.calibration). Without COMMAND it prints the
scheduler's address and holds the cluster until Ctrl-C.
--probe first streams 32 MiB between every node and the hub each way (crossing that node's
uplink only) and prints the rates.
The exit status is COMMAND's. Ctrl-C, SIGTERM or a failure removes every namespace, link
and process the harness made.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from shardflow.emulation.calibration import parse_time_scale
from shardflow.emulation.network import cannot_emulate, remove_on_stop_signals
from shardflow.errors import InputError
from shardflow.planner.topology import load_topology

PROBE_BYTES = 32 << 20


def _time_scale(text: str) -> float | str:
    try:
        return parse_time_scale(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _logs(folder: Path | None) -> None:
    """The folder --logs names, made now: refused before any work (without --logs, a new temp folder is made
    once nothing is refused)."""
    if folder is None:
        return
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--logs {folder} is a file; accepted: a folder, made if absent")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--logs {folder}: {e.strerror.lower()}; accepted: a folder, made if absent") from None


def parser() -> argparse.ArgumentParser:
    first, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(
        prog="python -m shardflow.emulation", description=first, epilog=rest.split("\n\n", 1)[1],
        usage="%(prog)s [-h] [--time-scale auto|N] [--logs DIR] [--probe] TOPOLOGY [-- COMMAND ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("topology", metavar="TOPOLOGY",
                   help="topology YAML file (nodes, devices, uplink and intra-node rates)")
    p.add_argument("--time-scale", type=_time_scale, default="auto", metavar="auto|N",
                   help="every link rate is divided by this; auto (the default): 500 times this host's reference "
                        "step over the reference host's (shardflow.emulation.calibration, docs/emulation.md)")
    p.add_argument("--logs", type=Path, metavar="DIR",
                   help="folder for the scheduler's and workers' logs (default: a new temp folder)")
    p.add_argument("--probe", action="store_true", help="measure each uplink's rate both ways before COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser().parse_args(own)
    reason = cannot_emulate()
    if reason:
        print(f"shardflow.emulation: {reason}", file=sys.stderr)
        return 2
    remove_on_stop_signals()
    from shardflow.emulation.calibration import resolve_time_scale
    from shardflow.emulation.cluster import EmulatedCluster
    from shardflow.emulation.network import check_shaped_rates
    from shardflow.emulation.probe import stream_bytes_per_s

    try:
        topology = load_topology(args.topology)
        if command and shutil.which(command[0]) is None:  # `ip netns exec` would say so once the cluster is up
            raise InputError(f"COMMAND {command[0]!r}: no such program; accepted: a program on PATH, or a path to one")
        _logs(args.logs)
        scale, said = resolve_time_scale(args.time_scale, topology.devices)
        check_shaped_rates(topology, scale)
        if said:
            print(said, flush=True)
        logs = args.logs or Path(tempfile.mkdtemp(prefix="shardflow-emulation-"))  # made once nothing is refused
        with EmulatedCluster(topology, scale, logs) as cluster:
            net = cluster.network
            print(f"emulated {len(net.nodes)} nodes, {len(cluster.worker_addresses)} workers, rates / "
                  f"{net.time_scale:g}; scheduler {cluster.scheduler_address}; logs {logs}", flush=True)
            if args.probe:
                for k, node in enumerate(net.nodes):
                    out = stream_bytes_per_s(net, k, None, PROBE_BYTES)
                    back = stream_bytes_per_s(net, None, k, PROBE_BYTES)
                    print(f"  uplink {node.name}: shaped {node.uplink_bytes_per_s * 8 / 1e6:,.0f} Mbit/s each way; "
                          f"a stream to the hub {out * 8 / 1e6:,.0f}, from it {back * 8 / 1e6:,.0f} Mbit/s",
                          flush=True)
            if not command:
                while True:
                    time.sleep(3600)
            proc = cluster.command([part.replace("{scheduler}", cluster.scheduler_address) for part in command])
            try:
                return proc.wait()
            except BaseException:
                proc.terminate()
                proc.wait()
                raise
    except InputError as e:
        print(f"shardflow.emulation: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardflow.emulation: interrupted; the emulated cluster is removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

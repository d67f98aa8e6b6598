"""The Dask cluster classes a run may name, and what each of their arguments may be.

Two rules, checked before anything is imported, started or written:

- **A config value never runs code.** Only the keys listed here are taken, each with a
  type and a bound; no key names code (preload, plugins, worker_class, specs,
  pre_import, job-script lines, security objects, environment variables).
- **Nothing listens beyond this machine unless the config says so, and then with TLS.**
  A local cluster's scheduler, nannies, workers and dashboard bind loopback. A value
  that binds another address (a `host`, an `interface` with other addresses, a
  dashboard on another host) or a class whose scheduler serves other machines (the
  dask_jobqueue classes) is accepted only with the cluster section's TLS files
  (`tls_ca_file`, `tls_cert`, `tls_key`), from which shardflow builds Dask's `Security`
  (mutual TLS, encryption required).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardflow.errors import InputError, brief

LOCAL_WORKERS_PER_CORE = 4  # a local cluster beyond this only thrashes (each worker is a process)
# What a local worker takes before it holds a row: the interpreter with PyTorch, zarr and the engine imported
# (0.39 GiB resident, measured on a local worker here). Dask restarts a worker over its memory_limit: a limit
# below this restarted workers without end (1kB: 299 restarts in 240 s).
WORKER_BASE_BYTES = 1 << 30
MAX_JOBS = 4096  # dask_jobqueue jobs, Kubernetes workers
WORD = re.compile(r"[A-Za-z0-9_.:@/+=,%-]{0,256}")
K8S_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
IMAGE = re.compile(r"[a-z0-9][a-z0-9._/-]{0,254}(:[A-Za-z0-9_.-]{1,128})?(@sha256:[0-9a-f]{64})?")
WALLTIME = re.compile(r"(\d{1,3}-)?\d{1,3}:\d{2}(:\d{2})?")
GPU_ID = re.compile(r"\d{1,3}|GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9a-fA-F/-]{8,80}")
SIZE_WORDS = ("auto",)


def cores() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def local_worker_limit() -> int:
    """The most processes a local cluster may start: LOCAL_WORKERS_PER_CORE per core, or 8."""
    return max(LOCAL_WORKERS_PER_CORE * cores(), 8)


def check_local_workers(workers: object) -> int:
    """`workers`, the size of a local cluster (one process per device), if it is one this machine takes."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers = {workers!r}; accepted: an integer >= 1")
    limit = local_worker_limit()
    if workers > limit:
        raise InputError(
            f"workers = {workers:,}: a local cluster of {workers:,} processes (one per device) on "
            f"{cores()} cores; accepted: at most {limit}, or a Dask cluster of its own for more (--scheduler "
            "ADDRESS on the command line; scheduler_address or cluster_class in a run's config)"
        )
    return workers


@dataclass(frozen=True)
class Rule:
    """What one cluster_kwargs key's value may be: `ok(value)`, said as `accepted`; `binds_beyond(value)` when
    the value makes something listen beyond loopback (then only with TLS)."""

    accepted: str
    ok: Callable[[object], bool]
    binds_beyond: Callable[[object], bool] = lambda value: False


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int, hi: int, why: str = "") -> Rule:
    return Rule(f"an integer from {lo} to {hi:,}{why}", lambda v: _is_int(v) and lo <= v <= hi)


BOOLEAN = Rule("true or false", lambda v: isinstance(v, bool))
TRUE = Rule("true (every device is a process of its own; false hangs the engine's actors)", lambda v: v is True)
PORT = Rule("an integer from 0 (any free port) to 65535", lambda v: _is_int(v) and 0 <= v <= 65535)
SECONDS = Rule("a number of seconds from 1 to 86400", lambda v: isinstance(v, (int, float)) and not isinstance(
    v, bool) and 1 <= v <= 86400)
PATH = Rule("a path of up to 256 of A-Z a-z 0-9 _ . : @ / + = , % -", lambda v: isinstance(v, str) and bool(
    v) and WORD.fullmatch(v) is not None)


def word(*choices: str) -> Rule:
    return Rule(f"one of {', '.join(choices)}", lambda v: v in choices)


def pattern(regex: re.Pattern, said: str) -> Rule:
    return Rule(said, lambda v: isinstance(v, str) and regex.fullmatch(v) is not None)


def size_bytes(v: object) -> int | None:
    """`v` (bytes, or Dask's '4GB' / '512 MiB') in bytes; None when it is neither."""
    from dask.utils import parse_bytes

    if _is_int(v):
        return int(v)
    if isinstance(v, float) and v.is_integer():  # `4e9` in a YAML file (a number, as in YAML 1.2)
        return int(v)
    if isinstance(v, str) and WORD.fullmatch(v.replace(" ", "")):
        try:
            return int(parse_bytes(v))
        except (ValueError, TypeError):
            return None
    return None


def size(at_least: int, words: tuple[str, ...] = SIZE_WORDS) -> Rule:
    def ok(v: object) -> bool:
        if v in words:
            return True
        b = size_bytes(v)
        return b is not None and at_least <= b < 1 << 50
    unit, name = (2**30, "GiB") if at_least >= 2**30 else (2**20, "MiB")
    return Rule(f"a size of at least {at_least / unit:g} {name} ('4GB', '512MiB' or bytes)"
                + (f", or {', '.join(words)}" if words else ""), ok)


def fraction_or_size(at_least: int) -> Rule:
    inner = size(at_least, ("auto", "default"))
    return Rule(f"a fraction of the GPU's memory (0 < f <= 1) or {inner.accepted}",
                lambda v: (isinstance(v, float) and 0 < v <= 1) or inner.ok(v))


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


HOST = Rule("a loopback address (127.0.0.1, localhost, ::1); another only with TLS (cluster.tls_*)",
            lambda v: isinstance(v, str) and WORD.fullmatch(v) is not None and bool(v),
            binds_beyond=lambda v: not is_loopback_host(str(v)))


def _dashboard_host(v: object) -> str | None:
    host, colon, port = str(v).rpartition(":")
    return host if colon and port.isdigit() and int(port) <= 65535 else None


DASHBOARD = Rule(
    "HOST:PORT on a loopback host (127.0.0.1:8787, 127.0.0.1:0 for any port), or null for none; another host "
    "only with TLS (cluster.tls_*)",
    lambda v: v is None or v is False or (isinstance(v, str) and WORD.fullmatch(v) is not None
                                          and _dashboard_host(v) is not None),
    binds_beyond=lambda v: v not in (None, False) and not is_loopback_host(_dashboard_host(v) or ""),
)


def interface_addresses(name: str) -> list[str] | None:
    """The addresses of this machine's network interface `name`; None when there is none of that name."""
    import psutil

    found = psutil.net_if_addrs().get(name)
    if found is None:
        return None
    return [a.address.split("%")[0] for a in found if a.family.name in ("AF_INET", "AF_INET6")]


def _interface_ok(v: object) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", v) is not None and \
        interface_addresses(v) is not None


INTERFACE = Rule(
    "a network interface of this machine (the loopback one; another only with TLS: cluster.tls_*)", _interface_ok,
    binds_beyond=lambda v: not all(is_loopback_host(a) for a in interface_addresses(str(v)) or []),
)
REMOTE_INTERFACE = pattern(re.compile(r"[A-Za-z0-9_.:-]{1,15}"), "a network interface name (ib0, eth0)")


def _resources(v: object) -> bool:
    return isinstance(v, dict) and len(v) <= 16 and all(
        isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", k) and isinstance(n, (int, float))
        and not isinstance(n, bool) and 0 < n <= 1e6 for k, n in v.items())


RESOURCES = Rule("a map of resource names to positive numbers (GPU: 1)", _resources)


def _k8s_resources(v: object) -> bool:
    return isinstance(v, dict) and set(v) <= {"requests", "limits"} and all(
        isinstance(m, dict) and len(m) <= 8 and all(
            isinstance(k, str) and re.fullmatch(r"[a-z0-9./-]{1,64}", k) and isinstance(q, (str, int))
            and not isinstance(q, bool) and re.fullmatch(r"[0-9]{1,12}(\.[0-9]{1,6})?[A-Za-z]{0,2}", str(q))
            for k, q in m.items()) for m in v.values())


K8S_RESOURCES = Rule("{requests: {cpu: '2', memory: 8Gi, nvidia.com/gpu: 1}, limits: {...}}", _k8s_resources)


def _gpus(v: object) -> bool:
    if isinstance(v, list):
        return 0 < len(v) <= 256 and all(_is_int(g) and 0 <= g < 256 for g in v)
    return isinstance(v, str) and 0 < len(v) <= 4096 and all(GPU_ID.fullmatch(g) for g in v.split(","))


GPUS = Rule("a list of GPU indices ([0, 1]) or a comma-separated string of indices or GPU-/MIG- UUIDs", _gpus)

_LOCAL = {
    "n_workers": integer(1, local_worker_limit(), f" ({LOCAL_WORKERS_PER_CORE} per core here, or 8)"),
    "threads_per_worker": integer(1, cores(), " (this machine's cores)"),
    "processes": TRUE,
    "memory_limit": size(WORKER_BASE_BYTES, ("auto",)),
    "host": HOST,
    "scheduler_port": PORT,
    "dashboard_address": DASHBOARD,
    "worker_dashboard_address": DASHBOARD,
    "protocol": word("tcp", "tls"),
    "interface": INTERFACE,
    "resources": RESOURCES,
}
_CUDA = {
    **{k: v for k, v in _LOCAL.items() if k != "processes"},
    "CUDA_VISIBLE_DEVICES": GPUS,
    "protocol": word("tcp", "tls", "ucx"),
    "device_memory_limit": fraction_or_size(1 << 28),
    "local_directory": PATH,
    "enable_tcp_over_ucx": BOOLEAN,
    "enable_infiniband": BOOLEAN,
    "enable_nvlink": BOOLEAN,
    "enable_rdmacm": BOOLEAN,
    "rmm_pool_size": size(1 << 20, ()),
    "rmm_maximum_pool_size": size(1 << 20, ()),
    "rmm_release_threshold": size(1 << 20, ()),
    "rmm_managed_memory": BOOLEAN,
    "rmm_async": BOOLEAN,
}
_KUBE = {
    "name": pattern(K8S_NAME, "a Kubernetes name (lower-case letters, digits and -, at most 63)"),
    "namespace": pattern(K8S_NAME, "a Kubernetes namespace (lower-case letters, digits and -, at most 63)"),
    "image": pattern(IMAGE, "a container image with this project installed (registry/name:tag or @sha256:...)"),
    "n_workers": integer(0, MAX_JOBS),
    "resources": K8S_RESOURCES,
    "port_forward_cluster_ip": BOOLEAN,
    "shutdown_on_close": BOOLEAN,
    "idle_timeout": integer(0, 86400),
    "resource_timeout": integer(0, 86400),
    "scheduler_service_type": word("ClusterIP"),
    "scheduler_forward_port": PORT,
    "quiet": BOOLEAN,
}
_JOBQUEUE = {
    "cores": integer(1, 4096),
    "memory": size(WORKER_BASE_BYTES, ()),
    "processes": integer(1, 1024),
    "queue": pattern(WORD, "a queue name of A-Z a-z 0-9 _ . : @ / + = , % -"),
    "account": pattern(WORD, "an account name of A-Z a-z 0-9 _ . : @ / + = , % -"),
    "project": pattern(WORD, "a project name of A-Z a-z 0-9 _ . : @ / + = , % -"),
    "walltime": pattern(WALLTIME, "HH:MM:SS (or D-HH:MM:SS)"),
    "n_workers": integer(0, MAX_JOBS),
    "interface": REMOTE_INTERFACE,
    "local_directory": PATH,
    "death_timeout": SECONDS,
}
JOBQUEUE_CLASSES = tuple(f"dask_jobqueue.{name}" for name in ("SLURMCluster", "PBSCluster", "SGECluster",
                                                              "LSFCluster", "OARCluster", "HTCondorCluster",
                                                              "MoabCluster"))
# The cluster classes a run may name, and the only cluster_kwargs each takes (docs/runs.md).
CLUSTER_KWARGS: dict[str, dict[str, Rule]] = {
    "distributed.LocalCluster": _LOCAL,
    "dask_cuda.LocalCUDACluster": _CUDA,
    "dask_kubernetes.operator.KubeCluster": _KUBE,
    **{name: _JOBQUEUE for name in JOBQUEUE_CLASSES},
}
LOCAL_CLASSES = ("distributed.LocalCluster", "dask_cuda.LocalCUDACluster")  # their workers are this machine's
# A class whose scheduler listens on this machine for workers elsewhere: only with TLS.
SERVES_THE_NETWORK = JOBQUEUE_CLASSES


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files Dask's mutual TLS is built from: the CA every party trusts, and this cluster's certificate
    and key (the scheduler's, the workers' and the client's)."""

    ca_file: str
    cert: str
    key: str

    @classmethod
    def parse(cls, ca_file: str | None, cert: str | None, key: str | None) -> TlsFiles | None:
        given = {"tls_ca_file": ca_file, "tls_cert": cert, "tls_key": key}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            raise InputError(f"{', '.join(missing)} missing beside {', '.join(k for k, v in given.items() if v)}; "
                             "accepted: all three TLS files (tls_ca_file, tls_cert, tls_key), or none")
        for k, v in given.items():
            check_pem(k, v)
        return cls(ca_file, cert, key)

    def security(self):
        """Dask's Security for every party of the cluster: mutual TLS, encryption required."""
        from distributed.security import Security

        return Security(tls_ca_file=self.ca_file, tls_client_cert=self.cert, tls_client_key=self.key,
                        tls_scheduler_cert=self.cert, tls_scheduler_key=self.key, tls_worker_cert=self.cert,
                        tls_worker_key=self.key, require_encryption=True)


def check_pem(key: str, path: str) -> str:
    """`path` if it is a readable PEM file (read up to its first line, nothing more is said of it)."""
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            first = f.read(64)
    except OSError as e:
        raise InputError(f"cluster.{key} = {path!r}: {e.strerror or type(e).__name__}; accepted: a readable PEM "
                         "file") from None
    if not first.startswith(b"-----BEGIN "):
        raise InputError(f"cluster.{key} = {path!r}: not a PEM file (it does not start with '-----BEGIN '); "
                         "accepted: a PEM certificate or key")
    return path


def check_tls_address(address: str | None, tls: TlsFiles | None) -> None:
    """A tls:// scheduler address needs the TLS files to be reached."""
    if (address or "").startswith("tls://") and tls is None:
        raise InputError(f"scheduler_address {address!r} without TLS files; accepted: with cluster.tls_ca_file, "
                         "tls_cert and tls_key (or a tcp:// scheduler)")


def check_cluster_class(path: str) -> str:
    """`path` if it names one of CLUSTER_KWARGS' classes (nothing is imported); else an InputError."""
    if path not in CLUSTER_KWARGS:
        raise InputError(f"cluster_class {path!r}: not an allowed cluster class; accepted: one of "
                         f"{', '.join(CLUSTER_KWARGS)}")
    return path


def check_cluster_kwargs(path: str | None, kwargs: dict, tls: TlsFiles | None = None) -> dict:
    """`kwargs` if every key is one `path`'s class takes, every value within its Rule, and nothing binds beyond
    loopback without `tls`; else an InputError naming the first key or value that is not."""
    if kwargs and path is None:
        raise InputError(f"cluster_kwargs {sorted(kwargs)} without a cluster_class; accepted: none, or a cluster_class")
    rules = CLUSTER_KWARGS.get(path or "", {})
    for key, value in kwargs.items():
        rule = rules.get(key)
        if rule is None:
            raise InputError(f"cluster_kwargs key {key!r} for {path}; accepted: {', '.join(rules) or 'none'} "
                             "(plain values only: no key that names code)")
        if not rule.ok(value):
            raise InputError(f"cluster_kwargs.{key} = {brief(value)}; accepted: {rule.accepted}")
        if tls is None and rule.binds_beyond(value):
            raise InputError(f"cluster_kwargs.{key} = {brief(value)} listens beyond this machine without TLS; "
                             f"accepted: {rule.accepted}")
    if path in SERVES_THE_NETWORK and tls is None:
        raise InputError(f"cluster_class {path!r} without TLS: its scheduler would take unauthenticated "
                         "connections from the network; accepted: with cluster.tls_ca_file, tls_cert and tls_key")
    if tls is not None and kwargs.get("protocol") not in (None, "tls"):
        raise InputError(f"cluster_kwargs.protocol = {kwargs['protocol']!r} with TLS files; accepted: tls, or "
                         "leave it out")
    return kwargs


def check_workers_fit(path: str | None, kwargs: dict, devices: int) -> None:
    """A local cluster class's n_workers is the topology's device count (one worker per device): fewer would
    leave the run waiting for workers that never come, more idle processes."""
    n = kwargs.get("n_workers")
    if path in LOCAL_CLASSES and n is not None and n != devices:
        raise InputError(f"cluster_kwargs.n_workers = {n} for a topology of {devices} devices; accepted: "
                         f"{devices} (one worker per device), or leave it out")
    limit = size_bytes(kwargs.get("memory_limit"))
    if path in LOCAL_CLASSES and limit and limit * devices > _machine_memory():
        raise InputError(f"cluster_kwargs.memory_limit = {kwargs['memory_limit']} × {devices} workers is more "
                         f"than this machine's {_machine_memory() / 2**30:,.1f} GiB; accepted: at most "
                         f"{_machine_memory() // devices / 2**30:,.1f} GiB, or auto")


def _machine_memory() -> int:
    import psutil

    return psutil.virtual_memory().total

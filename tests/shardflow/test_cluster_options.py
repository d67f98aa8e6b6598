"""The cluster classes and arguments a config may name: every refused vector is one line naming the key, the
value and what is accepted, before anything is imported, started or written; plain values within bounds pass.

Unit tier: config only, no cluster (tests/shardflow/test_cluster_tls.py starts real ones).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardflow.cluster_options import CLUSTER_KWARGS, TlsFiles, check_cluster_kwargs, local_worker_limit
from shardflow.config import RetrainConfig
from shardflow.errors import InputError
from shardflow.safe_yaml import load_text
from support import pem_files, snapshot

TOPOLOGY = "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
LOCAL, CUDA = "distributed.LocalCluster", "dask_cuda.LocalCUDACluster"
KUBE, SLURM = "dask_kubernetes.operator.KubeCluster", "dask_jobqueue.SLURMCluster"

# (cluster_class, cluster_kwargs, what the one line says): each way a value was found to run code, listen on the
# network, hang or restart a run, or fail later with a traceback (issues 64 and 65).
REFUSED = {
    "host_on_every_interface": (LOCAL, {"host": "0.0.0.0", "n_workers": 2},
                                "cluster_kwargs.host = '0.0.0.0' listens beyond this machine without TLS"),
    "dashboard_on_every_interface": (LOCAL, {"dashboard_address": ":8787"},
                                     "cluster_kwargs.dashboard_address = ':8787' listens beyond this machine"),
    "worker_dashboards_on_every_interface": (LOCAL, {"worker_dashboard_address": "0.0.0.0:0"},
                                             "cluster_kwargs.worker_dashboard_address = '0.0.0.0:0' listens"),
    "a_string_for_a_count": (LOCAL, {"n_workers": "2"}, "cluster_kwargs.n_workers = '2'; accepted: an integer"),
    "a_boolean_for_a_count": (LOCAL, {"n_workers": True}, "cluster_kwargs.n_workers = True; accepted: an integer"),
    "more_workers_than_the_machine_takes": (LOCAL, {"n_workers": 16},
                                            f"cluster_kwargs.n_workers = 16; accepted: an integer from 1 to "
                                            f"{local_worker_limit()}"),
    "fewer_workers_than_devices": (LOCAL, {"n_workers": 1},
                                   "cluster_kwargs.n_workers = 1 for a topology of 2 devices; accepted: 2"),
    "an_unknown_protocol": (LOCAL, {"protocol": "evil"}, "cluster_kwargs.protocol = 'evil'; accepted: one of tcp"),
    "inproc_workers": (LOCAL, {"protocol": "inproc"}, "cluster_kwargs.protocol = 'inproc'; accepted: one of tcp"),
    "an_interface_the_machine_has_not": (LOCAL, {"interface": "nonexist0"},
                                         "cluster_kwargs.interface = 'nonexist0'; accepted: a network interface"),
    "a_memory_limit_no_worker_starts_in": (LOCAL, {"memory_limit": "1kB"},
                                           "cluster_kwargs.memory_limit = '1kB'; accepted: a size of at least 1 GiB"),
    "a_memory_limit_past_the_machine": (LOCAL, {"memory_limit": "100TB"},
                                        "cluster_kwargs.memory_limit = 100TB × 2 workers is more than this machine"),
    "threads_instead_of_processes": (LOCAL, {"processes": False}, "cluster_kwargs.processes = False; accepted: true"),
    "more_threads_than_cores": (LOCAL, {"threads_per_worker": 10**6}, "cluster_kwargs.threads_per_worker = 1000000"),
    "a_resource_that_is_not_a_number": (LOCAL, {"resources": {"GPU": "one"}}, "cluster_kwargs.resources = "),
    "cuda_pre_import": (CUDA, {"pre_import": ["os"]}, "cluster_kwargs key 'pre_import' for dask_cuda"),
    "cuda_rmm_allocator_libraries": (CUDA, {"rmm_allocator_external_lib_list": ["torch"]},
                                     "cluster_kwargs key 'rmm_allocator_external_lib_list'"),
    "cuda_worker_class": (CUDA, {"worker_class": "subprocess.Popen"}, "cluster_kwargs key 'worker_class'"),
    "cuda_devices_that_are_commands": (CUDA, {"CUDA_VISIBLE_DEVICES": "0;touch x"},
                                       "cluster_kwargs.CUDA_VISIBLE_DEVICES = '0;touch x'"),
    "cuda_host_on_every_interface": (CUDA, {"host": "0.0.0.0"}, "cluster_kwargs.host = '0.0.0.0' listens beyond"),
    "kube_worker_command": (KUBE, {"worker_command": ["sh", "-c", "touch x"]}, "cluster_kwargs key 'worker_command'"),
    "kube_custom_spec": (KUBE, {"custom_cluster_spec": {"spec": {}}}, "cluster_kwargs key 'custom_cluster_spec'"),
    "kube_environment": (KUBE, {"env": {"LD_PRELOAD": "/tmp/x.so"}}, "cluster_kwargs key 'env'"),
    "kube_scheduler_on_a_public_service": (KUBE, {"scheduler_service_type": "LoadBalancer"},
                                           "cluster_kwargs.scheduler_service_type = 'LoadBalancer'; accepted: one of "
                                           "ClusterIP"),
    "kube_image_with_a_space": (KUBE, {"image": "img; touch x"}, "cluster_kwargs.image = 'img; touch x'"),
    "jobqueue_without_tls": (SLURM, {"cores": 2}, "cluster_class 'dask_jobqueue.SLURMCluster' without TLS"),
    "jobqueue_walltime_with_a_line": (SLURM, {"walltime": "01:00:00\ntouch x"}, "cluster_kwargs.walltime = "),
}


@pytest.fixture
def topology(tmp_path: Path) -> str:
    (tmp_path / "topology.yaml").write_text(TOPOLOGY)
    return str(tmp_path / "topology.yaml")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_cluster_argument_out_of_bounds_is_one_line_before_anything_is_written(name, topology, tmp_path):
    cls, kwargs, message = REFUSED[name]
    before = snapshot(tmp_path)
    with pytest.raises(InputError, match=re.escape(message)) as refused:
        RetrainConfig.build({"topology": topology, "run_dir": str(tmp_path / "run"), "cluster_class": cls,
                             "cluster_kwargs": kwargs})
    assert "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()  # no run_dir, nothing else


def test_plain_values_within_their_bounds_pass_for_every_class_not_vacuous(topology):
    RetrainConfig.build({"topology": topology, "cluster_class": LOCAL, "cluster_kwargs": {
        "n_workers": 2, "threads_per_worker": 1, "processes": True, "memory_limit": "2GB", "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0", "worker_dashboard_address": None, "protocol": "tcp", "interface": "lo",
        "resources": {"GPU": 1}, "scheduler_port": 0}})
    # The classes whose packages this machine lacks: every argument is checked before the import is tried.
    check_cluster_kwargs(CUDA, {"CUDA_VISIBLE_DEVICES": [0, 1], "n_workers": 2, "device_memory_limit": 0.8,
                                "rmm_pool_size": "24GB", "enable_nvlink": True, "protocol": "ucx",
                                "local_directory": "/scratch/dask"})
    check_cluster_kwargs(CUDA, {"CUDA_VISIBLE_DEVICES": "0,GPU-6a9e7f1c-1f5b-2c4d-9e8f-0a1b2c3d4e5f"})
    check_cluster_kwargs(LOCAL, load_text("{memory_limit: 4e9}", "cfg"))  # a number in YAML 1.2, as Dask takes it
    check_cluster_kwargs(KUBE, {"name": "nightly", "namespace": "recsys", "image": "ghcr.io/acme/shardflow:0.1.0",
                                "n_workers": 8, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}},
                                "shutdown_on_close": True})


def test_every_allowed_key_of_every_class_has_a_bound_that_refuses_something():
    """No key is a pass-through: each rule refuses a value of the wrong type."""
    for cls, rules in CLUSTER_KWARGS.items():
        for key, rule in rules.items():
            assert not rule.ok(object()), f"{cls}.{key} takes any value"
            assert not rule.ok("a b; touch x"), f"{cls}.{key} takes a value with a space"


def test_a_class_whose_package_is_missing_names_the_package_to_install(topology):
    with pytest.raises(InputError, match=r"dask-cuda is not installed here; .* \(pip install dask-cuda\)"):
        RetrainConfig.build({"topology": topology, "cluster_class": CUDA, "cluster_kwargs": {"n_workers": 2}})


def test_tls_files_let_a_value_bind_beyond_loopback_and_build_a_security_that_requires_encryption(tmp_path,
                                                                                                   topology):
    files = pem_files(tmp_path)
    config = RetrainConfig.build({"topology": topology, "cluster_class": LOCAL,
                                  "cluster_kwargs": {"host": "0.0.0.0"}, **files})
    security = TlsFiles.parse(config.cluster.tls_ca_file, config.cluster.tls_cert, config.cluster.tls_key).security()
    assert security.require_encryption and security.tls_ca_file == files["tls_ca_file"]
    with pytest.raises(InputError, match=r"cluster_kwargs.protocol = 'tcp' with TLS files; accepted: tls"):
        RetrainConfig.build({"topology": topology, "cluster_class": LOCAL, "cluster_kwargs": {"protocol": "tcp"},
                             **files})


@pytest.mark.parametrize("given, message", [
    ({"tls_cert": "CERT"}, r"tls_ca_file, tls_key missing beside tls_cert; accepted: all three TLS files"),
    ({"tls_ca_file": "/nonexistent/ca.pem", "tls_cert": "CERT", "tls_key": "KEY"},
     r"cluster.tls_ca_file = '/nonexistent/ca.pem': No such file or directory; accepted: a readable PEM file"),
    ({"tls_ca_file": "NOTPEM", "tls_cert": "CERT", "tls_key": "KEY"},
     r"cluster.tls_ca_file = '.*notes.txt': not a PEM file .*; accepted: a PEM certificate or key"),
    ({"scheduler_address": "tls://127.0.0.1:8786"}, r"scheduler_address 'tls://127.0.0.1:8786' without TLS files"),
])
def test_tls_files_are_all_three_readable_pem_files(given, message, tmp_path, topology):
    files = pem_files(tmp_path)
    (tmp_path / "notes.txt").write_text("secret line that must not be quoted\n")
    values = {k: {"CERT": files["tls_cert"], "KEY": files["tls_key"], "NOTPEM": str(tmp_path / "notes.txt")}.get(v, v)
              for k, v in given.items()}
    with pytest.raises(InputError, match=message) as refused:
        RetrainConfig.build({"topology": topology, **values})
    assert "secret line" not in str(refused.value)

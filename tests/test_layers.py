"""Dependencies point one way (docs/DESIGN.md, "Layout"): no cycle between folders, a pure core, storage beside
the stages, the CLI outside the core package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shardflow", "tasks", "flows", "storage", "cli")
CORE = ("shardflow.planner", "shardflow.model", "shardflow.training.protocol", "shardflow.training.messages",
        "shardflow.training.inprocess", "shardflow.training.relay", "shardflow.training.replicas",
        "shardflow.training.shard",
        "shardflow.errors", "shardflow.hashing", "shardflow.safe_yaml")
NOT_IN_CORE = ("distributed", "dask", "prefect", "zarr", "storage", "tasks", "flows", "cli")


def group(module: str) -> str:
    """The folder a module belongs to: shardflow's subpackages and top-level modules each count as one."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "shardflow" and len(parts) > 1 else parts[0]


def imports() -> dict[str, set[str]]:
    """{module: every module it imports, at any depth of its code}."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            names = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module)
                elif isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
            out[module] = names
    return out


def folder_edges(found: dict[str, set[str]]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, names in found.items():
        for name in names:
            if name.split(".")[0] in PACKAGES and group(name) != group(module):
                edges.setdefault(group(module), set()).add(group(name))
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of folders, if there is one."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(edges) if n not in state and (c := visit(n, [n]))), None)


def test_the_checker_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_cycle_between_folders():
    edges = folder_edges(imports())
    assert "shardflow.training" in edges and "shardflow.sharding" in edges["shardflow.training"]  # read
    assert cycle(edges) is None, cycle(edges)


def test_the_core_imports_no_dask_prefect_zarr_or_storage():
    bad = {f"{m} imports {n}" for m, names in imports().items() if m.startswith(CORE)
           for n in names if n.split(".")[0] in NOT_IN_CORE}
    assert not bad, sorted(bad)


def test_storage_imports_only_the_error_types_and_the_record_parser_of_shardflow():
    bad = {f"{m} imports {n}" for m, names in imports().items() if m.startswith("storage")
           for n in names if n.split(".")[0] in PACKAGES and n.split(".")[0] != "storage"
           and n not in ("shardflow.errors", "shardflow.records")}
    assert not bad, sorted(bad)


def test_only_the_cli_and_flows_sit_above_the_tasks():
    found = imports()
    above = {m for m, names in found.items() for n in names if n.split(".")[0] in ("tasks", "flows", "cli")
             and m.split(".")[0] not in ("tasks", "flows", "cli")}
    assert not above, sorted(above)
    assert not any(n.split(".")[0] == "cli" for m, names in found.items() if not m.startswith("cli") for n in names)


CONFIG_CHECKS = """
import sys
from shardflow.config import RetrainConfig
from shardflow.errors import InputError
RetrainConfig.build({"run_dir": "r", "model": {"encoder": "self-attention"}})
for bad in ({"train": {"batch_size": 1}}, {"train": {"batch_size": 10**9}}):
    try:
        RetrainConfig.build({"run_dir": "r", **bad})
    except InputError:
        pass
    else:
        raise SystemExit(f"accepted {bad}")
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
"""


def test_the_config_and_every_check_of_it_import_no_pytorch():
    """A bad config is refused in about a second: its checks (batch against trainers, the step's memory bound
    with the attention's shapes) are arithmetic; importing PyTorch took 3-4 s of a refusal's 5 s."""
    done = subprocess.run([sys.executable, "-c", CONFIG_CHECKS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]"]


BEFORE_THE_API = """
import sys
import cli.launch, shardflow.lifecycle, shardflow.preflight
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
"""


def test_what_a_run_does_before_its_api_starts_imports_no_pytorch(tmp_path):
    """`shardflow run`'s pre-flight and its answer to a night with nothing new import no PyTorch (1.7 s of a
    3.5 s answer here): its models' configs are in shardflow.model.configs. A pre-flight refusal, taken as a user
    takes it: a directory of parts none of which is finished yet."""
    done = subprocess.run([sys.executable, "-c", BEFORE_THE_API], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]"]
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "day-1.txt").write_text("1 1\n1 2")  # no newline at its end: still being written
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "cli.main", "run", "--set", f"dataset={parts}",
                           "--set", f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == 1 and "no finished part yet (day-1.txt (does not end with a newline))" in said[0], said
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "shardflow.preflight" in imported and not any(m.split(".")[0] == "torch" for m in imported)
    assert not (tmp_path / "run").exists()

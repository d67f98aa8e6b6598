"""No module of this repository shadows a standard-library or installed one.

Prefect puts a deployment entrypoint's folder (`flows/`) first on `sys.path`, and the
pull step's working directory (the repository root) on it too; Dask workers spawned by
that process inherit both; `python bench/X.py` puts `bench/` first; pytest adds `tests/`.
A file `flows/profile.py` once made torch's `import cProfile` fail in every worker of a
deployment run (AttributeError: module 'profile' has no attribute 'run').
"""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders whose files become top-level module names, and why.
ON_PATH = {
    ROOT: "the working directory of a deployment run",
    ROOT / "flows": "the folder of the deployments' entrypoints",
    ROOT / "bench": "benchmarks run as scripts",
    ROOT / "tests": "pytest's pythonpath",
}


def top_level_names(folder: Path) -> set[str]:
    """The names `import NAME` finds in `folder`: modules and packages."""
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return names


def elsewhere(name: str) -> str | None:
    """Where `name` is found outside this repository: the standard library or an installed package."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return "the standard library"
    venv = Path(sys.prefix).resolve()
    outside = [p for p in sys.path if p and (not Path(p).resolve().is_relative_to(ROOT)
                                             or Path(p).resolve().is_relative_to(venv))]  # the repo's own folders out
    spec = importlib.machinery.PathFinder.find_spec(name, outside)
    return None if spec is None else str(spec.origin or spec.submodule_search_locations)


def test_the_checker_finds_a_shadowing_name():
    """Not vacuous: the names that broke the deployments, and an installed package, are found."""
    assert elsewhere("profile") == "the standard library"
    assert elsewhere("torch") is not None
    assert elsewhere("shardflow_no_such_module") is None


def test_no_file_on_a_path_prefect_dask_or_pytest_puts_first_shadows_a_module():
    shadowing = {f"{folder.relative_to(ROOT) if folder != ROOT else '.'}/{name} ({why}) shadows {found}"
                 for folder, why in ON_PATH.items() for name in top_level_names(folder)
                 if (found := elsewhere(name)) is not None}
    assert not shadowing, sorted(shadowing)
    assert "retrain" in top_level_names(ROOT / "flows")  # the folders were read


def test_the_console_script_pytest_imports_the_repositorys_packages_not_the_test_folders_named_like_them():
    """`pytest` (unlike `python -m pytest`) does not put the working directory on `sys.path`: with only `tests/`
    on pytest's pythonpath, `import shardflow` found the folder tests/shardflow and every test failed to import."""
    mirrored = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()} & top_level_names(ROOT)
    assert "shardflow" in mirrored  # what this test is about is still there
    done = subprocess.run([str(Path(sys.executable).parent / "pytest"), "--collect-only", "-q", "-p",
                           "no:cacheprovider", "tests/shardflow/planner/test_topology.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "tests collected" in done.stdout, (done.stdout + done.stderr)[-3000:]

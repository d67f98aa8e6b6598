# The README's commands. Every target is idempotent: the virtual environment is
# created once and reinstalled only when pyproject.toml or constraints.txt change.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --constraint constraints.txt
RUN    := runs/demo

.PHONY: install test test-quick lint run bench lock clean

install: $(VENV)/.installed

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) --editable .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) --editable '.[test]'
	touch $@

# The tests start hundreds of Python processes (pytest's and Dask's workers, the CLI, servers). Where the
# environment sets PYTHONDONTWRITEBYTECODE (CI's image does), each would compile the project's modules again:
# the unit tier spent 236 CPU-s so, 217 with its bytecode kept (2 cores). An empty value is Python's default.
test test-quick: export PYTHONDONTWRITEBYTECODE =

# Every tier (tests/conftest.py), after the linter; CI runs this. One session on two pytest workers (each
# its own LocalCluster and Prefect test harness), the tiers heaviest first: a worker left idle takes tests
# from the other's queue (--dist worksteal), so the cluster and server tests' waits are filled with other
# tests' work. `-m TIER` runs one tier. Prints how fast the host was before and after (bench/host_speed.py:
# the suite's minutes follow it; the first is there even when CI stops the suite at its time limit), the 15
# slowest tests, and each failure's one line as it happens (tests/conftest.py). A test still running after
# 15 minutes fails with its stacks (pyproject's timeout).
test: lint
	$(BIN)/python bench/host_speed.py
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15
	$(BIN)/python bench/host_speed.py

# The unit tier on every core: pure logic and real zarr stores, no cluster and no Prefect API.
test-quick: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m unit -n auto

# ruff everywhere; mypy, strict, on the pure core (pyproject.toml's [tool.mypy] names the folders).
lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy

# The main job: the whole retraining flow (flows/retrain.py) on the bundled amazon-video
# dataset over the demo topology (2 nodes × 2 devices), with Prefect's embedded API and a
# local Dask cluster: import, profile, shard, 10 epochs with checkpoints, download, evaluate.
# 10 epochs, a cap to keep it near 10 minutes on 2 cores: the defaults, uncapped, choose epoch 15-19
# on this log and stop about 10 later (docs/benchmarks.md, the whole-catalog table).
run: install
	$(BIN)/shardflow run --set run_dir=$(RUN) --set epochs=10

bench: $(VENV)/.installed-test
	$(BIN)/python bench/profile_throughput.py
	$(BIN)/python bench/plan_traffic.py
	$(BIN)/python bench/train_throughput.py --epoch-auc

# Re-resolve every pin from the package index into constraints.txt.
lock:
	rm -rf /tmp/shardflow-lock && $(PYTHON) -m venv /tmp/shardflow-lock
	/tmp/shardflow-lock/bin/python -m pip install --quiet '.[test]'
	/tmp/shardflow-lock/bin/python -m pip freeze --exclude shardflow > constraints.txt
	rm -rf /tmp/shardflow-lock

clean:
	rm -rf $(VENV) runs

# `make demo`, `make check`, `make test` and `make test-all` each set up what they need (the venv) by themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
DEMO := .demo

.PHONY: help venv ops demo test check test-all lint clean

# `make help`: each target's `## ` line below, one line each.
help:  ## this list
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  make %-9s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Two layers, each with its stamp: the job's own packages (torch and requirements.txt, what `make demo` needs), then
# the test and lint tools and the MLflow server's venv on top (`make test`, `check`, `lint`). uv installs them: it
# resolves, downloads and unpacks in parallel, which cut a fresh venv from minutes to about one on 2 cores. It
# compiles the bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI machines), a venv without
# it recompiles transformers and torch from source in every process, 15 s each (the suite ran 60% longer). It takes
# torch from the folder pip finds the local CPU wheel in (pip's find-links); with none, from PyPI, as pip would.
UV := $(VENV)/bin/uv pip install --quiet --compile-bytecode
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(VENV)/.job: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==0.13.9
	DS_BUILD_OPS=0 $(UV) --python $(PY) $(addprefix --find-links ,$(FIND_LINKS)) $(TORCH) -r requirements.txt  # deepspeed: no op built at install
	touch $@

# The MLflow tracking server the tests report to lives in a venv of its own inside $(VENV): the job's venv holds
# the image's client (mlflow-skinny) alone, so the job processes the tests start import what the image's do (the
# full mlflow brings scipy and scikit-learn, which transformers and evaluate then import at every start).
$(VENV)/.dev: $(VENV)/.job requirements-dev.txt requirements-mlflow-server.txt
	$(UV) --python $(PY) -r requirements-dev.txt
	$(VENV)/bin/uv venv --quiet --allow-existing --python $(PYTHON) $(VENV)/mlflow-server
	$(UV) --python $(VENV)/mlflow-server/bin/python -r requirements-mlflow-server.txt
	touch $@

venv: $(VENV)/.dev  ## build .venv: the job's packages, then the test and lint tools

# The whole job offline on 2 CPU cores: a tiny BERT built here, a bundled synthetic sample (examples/TASK-synthetic,
# made by scripts/make_demo_assets.py): SST-2-shaped by default, `make demo TASK=mnli` (sentence pairs, 3 classes,
# two validation splits) or `TASK=stsb` (pairs scored 0-5, a regression). A tiny randomly initialised model needs
# a higher learning rate than the real default (1e-3); the pair samples are smaller, so smaller batches.
# Each task keeps its own model and output (.demo/TASK/tiny-bert, .demo/TASK/output): the tasks' models differ in
# vocabulary and labels (2 classes, 3, a score), so one task's demo must not replace another's model under it.
TASK ?= sst2
DEMO_DATA := examples/$(TASK)-synthetic
DEMO_TASK := $(DEMO)/$(TASK)
demo: $(VENV)/.job  ## train a tiny BERT offline on a bundled sample (TASK=sst2, mnli or stsb), in .demo/TASK/output
	@test -d $(DEMO_DATA) || { echo "error: no bundled sample for TASK=$(TASK); use TASK=sst2, mnli or stsb" >&2; exit 2; }
	@$(PY) scripts/make_demo_assets.py model $(DEMO_TASK)/tiny-bert --data $(DEMO_DATA) --task $(TASK) >/dev/null
	@rm -rf $(DEMO_TASK)/output
	MODEL_NAME=$(DEMO_TASK)/tiny-bert DATASET_PATH=$(DEMO_DATA) OUTPUT_DIR=$(DEMO_TASK)/output $(if $(filter-out sst2,$(TASK)),TASK=$(TASK)) \
	  NUM_EPOCHS=3 PER_DEVICE_BATCH_SIZE=$(if $(filter sst2,$(TASK)),32,8) LEARNING_RATE=3e-3 DATALOADER_NUM_WORKERS=0 $(PY) main.py
	@echo "metrics: $(DEMO_TASK)/output/metrics.json; the run's story: $(DEMO_TASK)/output/logs/rank-0.log"

# DeepSpeed's CPU ops, compiled once per venv (a couple of minutes the first time, seconds after): the
# integration layer's DeepSpeed runs load them from $(VENV)/torch-extensions instead of paying the compile in a test.
ops: venv  ## compile DeepSpeed's CPU ops once per venv (the integration layer loads them)
	$(PY) scripts/build_deepspeed_ops.py

# The fast layer, for the edit-test loop, in one process: settings, the plan (batch, learning rates, numerics),
# data checks and the refusals, each checked in-process against the function main.py calls (tests marked `check`).
check: venv  ## the fast tests, in one process: settings, the plan, data checks, refusals
	$(PY) -m pytest -m check

# Two workers, each taking a whole file at a time (its module fixtures, such as one finished run read by many
# tests, are built once): on 2 cores the serial suite kept one core busy about half the time, its tests waiting
# on training processes and rendezvous timeouts.
TEST_WORKERS ?= 2
BY_FILE := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The suite the README gives: everything but the integration layer (the job in real processes, every launcher,
# the faults a restart recovers from).
test: venv  ## the test suite the README gives: everything but the integration layer
	$(PY) -m pytest $(BY_FILE) -m "not integration"

# Everything, as CI runs it: `make test`, then the integration layer (the image build, DeepSpeed on its compiled
# ops, the sweep backends end to end, the benchmarks' smoke runs, the long fault chains).
test-all: test ops  ## everything, as CI runs it: make test, then the integration layer
	$(PY) -m pytest $(BY_FILE) -m integration

# Lint and formatting as CI checks them; `$(VENV)/bin/ruff format .` fixes the formatting.
lint: venv  ## ruff check and format check, as CI runs them
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:  ## remove the demo's outputs and caches
	rm -rf $(DEMO) output .pytest_cache

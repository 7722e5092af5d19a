# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing, installs the pinned CPU torch unless a torch is
# already importable there (an unpinned `torch` would pull a multi-GB CUDA build),
# installs the project with what the target needs, then runs.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.stoker-installed

.PHONY: demo test browser docs lint format bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null \
		&& echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already installed" \
		|| $(PY) -m pip install --quiet $(TORCH_PIN)
	@touch $@

$(STAMP): pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/stoker demo

# The report test opens report.html in a real headless browser: Debian's chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
		|| { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "chromium missing and not root: the browser test will be skipped"

# Tests run split over pytest-xdist workers, one more than the cores: many of them wait
# on a subprocess (the CLI as a user runs it), so one worker per core leaves cores idle
# (on 2 cores: 10 min 22 s with 2 workers, 7 min 45 s with 3; 4 min 10 s since most CLI
# cases run in-process, tests/stoker_cli.py); idle workers take queued
# tests from busy ones (worksteal), so the long end-to-end runs do not all end on one.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(len(os.sched_getaffinity(0)) + 1)")
# (`python -m stoker.reference --check` is not repeated here: tests/unit/test_reference.py
# checks the committed references, and runs that very command once. mypy runs as a test
# too, tests/unit/test_types.py: on an xdist worker it overlaps the other tests instead of
# adding its ~30 s of cold CPU before them. ruff's D1 rules check the docstrings.)
test: $(STAMP) browser
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/mkdocs build --strict -q -d $$(mktemp -d)
	$(VENV)/bin/pytest -m "not slow" -q -n $(TEST_WORKERS) --dist worksteal --durations=15

# The user guide as a site in site/; the references are generated from the code first.
docs: $(STAMP)
	$(VENV)/bin/python -m stoker.reference
	$(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Side-by-side benchmarks (not part of make test): one summary table, JSON per benchmark
# in $(BENCH_OUT); then the tests marked slow. Lightning and HF datasets are installed for the
# comparison only, pinned to this torch.
BENCH_OUT ?= bench-out
bench: $(STAMP)
	@$(PY) -c "import lightning" 2>/dev/null || { \
	  $(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt && \
	  $(PY) -m pip install --quiet -c $(VENV)/torch-pin.txt lightning; } \
	  || echo "lightning not installed: its rows will say so"
	@$(PY) -c "import datasets" 2>/dev/null || { \
	  $(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt && \
	  $(PY) -m pip install --quiet -c $(VENV)/torch-pin.txt datasets; } \
	  || echo "datasets not installed: its rows will say so"
	@# The slow tests run even when a benchmark misses its target; make fails if either did.
	$(PY) benchmarks/run_all.py --out $(BENCH_OUT); bench=$$?; \
	  $(VENV)/bin/pytest -m slow -q -n $(TEST_WORKERS) && exit $$bench

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache

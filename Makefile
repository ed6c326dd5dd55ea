# make lab   - set up .venv (first time only) and open the course in JupyterLab; as root too,
#   and without a desktop it prints how to open it from a laptop. LAB_ARGS="--port 9999" (or
#   "--ip 0.0.0.0") adds options of `jupyter lab` (gradsync_tutorial/lab.py).
# make test  - set up .venv (first time only) and run every test, notebooks included (nbval, in
#   their short mode; SMOKE_TEST=0 make test runs them in full mode; conftest.py)
# make e2e   - only the end-to-end suite: the course in JupyterLab, in Chromium (tests/e2e)
# make data  - fetch Fashion-MNIST into data/ (internet, else Debian's dataset-fashion-mnist)
# make doctor - is this machine ready? versions, data, a 2-rank launch, expected notebook times
# make bench - the benchmark scripts (ratios measured side by side in one run)
# make clean - remove what the targets made: .venv, data/, build/ (the site), checkpoints/,
#   test-artifacts/
# make notebooks [NB=02] - rebuild the notebooks (or one) from their sources notebooks/NN_*.py and
#   execute them top to bottom, full mode. PY=/path/to/python: use that ready interpreter instead
#   of .venv (no install or data step), e.g. a worktree with PYTHONPATH=$PWD.
# make site  - the course as a website, from the committed notebooks (no execution), into
#   build/site/html/ (installs the `site` extra; docs/build.py). PY= works as for notebooks.
# make gpu-check - on a machine with CUDA GPUs: every snippet and both scripts with nccl, the
#   checks of every notebook that calls gst.local_device(), on the GPUs, one table for the README
#   (~10 min; every part skipped, with the reason, without a GPU). PY= as for make notebooks.
# make times [NB=14] - execute every notebook in one run, timed (full mode, on a quiet machine),
#   and write the README's time table and the doctor's reference times from that run
#   (tools/time_table.py; TIMES_FLAGS=--write only rewrites them from the recorded run). NB=14
#   times that notebook alone and merges its time into the record (a new notebook).
# make images - the README's figures: every tools/draw_*.py draws one, the loss curves copied from
#   the notebooks' outputs (cells tagged image:NAME.png), and every tools/screenshot_*.py takes
#   its screenshots in Chromium (the site, built first, and JupyterLab). Running a notebook writes
#   no file.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA_FLAGS ?=
PY     ?= $(BIN)/python
NB     ?=
LAB_ARGS ?=
SITE_STAMP := $(VENV)/.installed-site
TIMES_FLAGS ?=

.PHONY: install lab test e2e data doctor bench lint clean notebooks images site gpu-check times

install: $(STAMP)

# Re-installs only when pyproject.toml changes, so a second `make` skips straight to work.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev,e2e,peers]'
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/python -m gradsync_tutorial.data $(DATA_FLAGS)

# Never downloads: it reports what is missing, with the command that fixes it.
doctor: $(STAMP)
	$(BIN)/python -m gradsync_tutorial doctor

# exec: make's own child is the launcher, so stopping make (SIGTERM) stops the server too
lab: $(if $(filter $(BIN)/python,$(PY)),data)
	exec $(PY) -m gradsync_tutorial lab $(LAB_ARGS)

test: data
	$(BIN)/python -m pytest

e2e: data
	$(BIN)/python -m pytest -m e2e tests/e2e

bench: data
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/epoch_time.py
	$(BIN)/python benchmarks/averaging.py
	$(BIN)/python benchmarks/exercise_checks.py
	$(BIN)/python benchmarks/verify_cost.py

# Only the default PY needs the course venv and the data set up first.
notebooks: $(if $(filter $(BIN)/python,$(PY)),data)
	$(PY) tools/build_notebooks.py $(NB)

$(SITE_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e '.[site]'
	touch $(SITE_STAMP)

site: $(if $(filter $(BIN)/python,$(PY)),$(SITE_STAMP))
	$(PY) docs/build.py build/site

gpu-check: $(if $(filter $(BIN)/python,$(PY)),data)
	$(PY) -m tests.gpu.check

times: $(if $(filter $(BIN)/python,$(PY)),data)
	$(PY) tools/time_table.py $(if $(NB),--only $(NB)) $(TIMES_FLAGS)

images: $(if $(filter $(BIN)/python,$(PY)),$(STAMP)) site
	for draw in tools/draw_*.py; do $(PY) $$draw || exit 1; done
	$(PY) tools/build_notebooks.py --images
	for shot in tools/screenshot_*.py; do $(PY) $$shot || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) data .pytest_cache build checkpoints test-artifacts

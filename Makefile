# make lab   - set up .venv (first time only) and open the course in JupyterLab
# make test  - set up .venv (first time only) and run every test, notebooks included (nbval)
# make e2e   - only the end-to-end suite: the course in JupyterLab, in Chromium (tests/e2e)
# make data  - fetch Fashion-MNIST into data/ (internet, else Debian's dataset-fashion-mnist)
# make doctor - is this machine ready? versions, data, a 2-rank launch, expected notebook times
# make bench - the benchmark scripts (ratios measured side by side in one run)
# make notebooks [NB=02] - rebuild the notebooks (or one) from their sources notebooks/NN_*.py and
#   execute them top to bottom, full mode. PY=/path/to/python: use that ready interpreter instead
#   of .venv (no install or data step), e.g. a worktree with PYTHONPATH=$PWD.
# make times - execute every notebook in one run, timed (full mode, on a quiet machine), and write
#   the README's time table and the doctor's reference times from that run
#   (scripts/time_table.py; TIMES_FLAGS=--write only rewrites them from the recorded run).
# make images - the README's figures: images/allreduce.png drawn, the loss curves copied from
#   the notebooks' outputs (cells tagged image:NAME.png). Running a notebook writes no file.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA_FLAGS ?=
PY     ?= $(BIN)/python
NB     ?=
TIMES_FLAGS ?=

.PHONY: install lab test e2e data doctor bench lint clean notebooks images times

install: $(STAMP)

# Re-installs only when pyproject.toml changes, so a second `make` skips straight to work.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev,e2e]'
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/python -m gradsync_tutorial.data $(DATA_FLAGS)

# Never downloads: it reports what is missing, with the command that fixes it.
doctor: $(STAMP)
	$(BIN)/python -m gradsync_tutorial doctor

lab: data
	$(BIN)/jupyter lab notebooks/

test: data
	$(BIN)/python -m pytest

e2e: data
	$(BIN)/python -m pytest -m e2e tests/e2e

bench: data
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/epoch_time.py
	$(BIN)/python benchmarks/averaging.py

# Only the default PY needs the course venv and the data set up first.
notebooks: $(if $(filter $(BIN)/python,$(PY)),data)
	$(PY) scripts/notebooks.py $(NB)

times: $(if $(filter $(BIN)/python,$(PY)),data)
	$(PY) scripts/time_table.py $(TIMES_FLAGS)

images: $(if $(filter $(BIN)/python,$(PY)),$(STAMP))
	$(PY) images/draw_allreduce.py
	$(PY) scripts/notebooks.py --images

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) data .pytest_cache

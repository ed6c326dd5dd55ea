# make lab   - set up .venv (first time only) and open the course in JupyterLab
# make test  - set up .venv (first time only) and run every test, notebooks included (nbval)
# make data  - fetch Fashion-MNIST into data/ (internet, else Debian's dataset-fashion-mnist)
# make doctor - is this machine ready? versions, data, a 2-rank launch, expected notebook times
# make bench - the benchmark scripts (ratios measured side by side in one run)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA_FLAGS ?=

.PHONY: install lab test data doctor bench lint clean

install: $(STAMP)

# Re-installs only when pyproject.toml changes, so a second `make` skips straight to work.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
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

bench: data
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/epoch_time.py
	$(BIN)/python benchmarks/averaging.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) data .pytest_cache

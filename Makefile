# Set-up and checks over a local virtual environment (.venv).
# TORCH_SPEC pins the CPU build that this project's CI machines carry on disk; on a GPU
# machine run `make install TORCH_SPEC=torch` (or install torch yourself first).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test lint bench figures clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: install
	$(BIN)/autopipe plan examples/gpt.py --gpus 8

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: install
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

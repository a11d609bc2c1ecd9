# Set-up and checks over a local virtual environment (.venv).
# TORCH_SPEC pins the CPU build that this project's CI machines carry on disk; on a GPU
# machine run `make install TORCH_SPEC=torch` (or install torch yourself first).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The frameworks' own code that tests/test_emit_frameworks.py and test_emit_context_expert.py
# feed the emitted configs to: torchtitan 0.3.0 (the current release: its config classes,
# ParallelDims and pipeline code) and Megatron-Core 0.16.1 (the newest for Python 3.11). Part
# of the `emit` extra, installed without dependencies, which would replace torch.
# torchao 0.18.0: torchtitan's Float8 (its Float8Linear), which
# benchmarks/compiled_block_bytes.py --float8 compiles to measure the FP8 casts' bytes
# (tests/test_compiled_block_bytes.py; its CUDA extensions are not needed on a CPU).
EMIT_CHECKS := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing tyro docstring-parser \
	typeguard megatron-core==0.16.1 einops torchao==0.18.0
# torchtitan 0.2.2, for the TOML's checks, in its own folder (one package name with 0.3.0):
# tests/test_emit_frameworks.py runs those checks in one child pytest with it first on
# PYTHONPATH.
TORCHTITAN_022 := $(VENV)/torchtitan-0.2.2

.PHONY: install demo test lint bench figures clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	# Until 0.1 the distribution was named autopipe: drop it from an older .venv (same import).
	$(BIN)/python -m pip uninstall -q -y autopipe 2>/dev/null || true
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(EMIT_CHECKS)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(TORCHTITAN_022) \
		torchtitan==0.2.2 torchdata
	touch $@

demo: install
	$(BIN)/autopipe plan examples/gpt.py --gpus 8

test: install
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# mypy sees the package as it installs: the layer folders under the autopipe namespace, laid
# out as links in build/typecheck (setuptools' editable finder is invisible to mypy).
lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	rm -rf build/typecheck && mkdir -p build/typecheck/autopipe
	for f in autopipe/*; do ln -s "$$PWD/$$f" build/typecheck/autopipe/; done
	for d in profiler planner runtime; do ln -s "$$PWD/$$d" build/typecheck/autopipe/$$d; done
	$(BIN)/mypy build/typecheck/autopipe

bench: install
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

# The README's figures: plan plots for examples/gpt.py on 8 stages, and a predicted-vs-measured
# timeline from running a 4-stage plan on this machine's CPU.
figures: install
	$(BIN)/autopipe plan examples/gpt.py --gpus 8 --batch-size 32 --plot docs/images -q
	mkdir -p build
	$(BIN)/autopipe plan examples/gpt.py --gpus 4 --json build/plan4.json -q
	$(BIN)/autopipe bench examples/gpt.py --plan build/plan4.json --steps 10 --out build/bench4
	cp build/bench4/timeline_compare.png docs/images/bench_compare.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

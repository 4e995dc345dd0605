# The README's commands. `make serve` and `make test` create .venv on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# Linux CPU: preload OpenBLAS for the test run when present (the server re-execs itself).
BLAS := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0))
PRELOAD := $(if $(BLAS),LD_PRELOAD=$(BLAS),)

.PHONY: serve test test-slow lint bench clean

# What serving needs (`make serve`): the package alone, no test clients or agent SDKs.
$(BIN)/.installed: pyproject.toml setup.py engines/platform/cpu_softmax.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e .
	touch $@

# The tests' extras on top (`make test`, lint): clients, SDKs, agents, Playwright.
# mlx-vlm without its dependencies (transformers 5, datasets, opencv, mlx-audio): the
# tests compare Tandem's drafter modules with its forwards on the same weights.
$(BIN)/.installed-dev: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps 'mlx-vlm==0.7.10'
	touch $@

serve: $(BIN)/.installed
	$(BIN)/tandem serve --demo

test: $(BIN)/.installed-dev
	$(PRELOAD) $(BIN)/pytest -q

# lm-eval for tests/test_lm_eval.py (slow tier) only, kept out of '.[dev]': its other
# extras pull in torch. Its `api` extra (local-completions) needs none; ~20 s to install.
$(BIN)/.installed-lm-eval: $(BIN)/.installed-dev
	$(BIN)/pip install -q 'lm-eval[api]==0.4.13'
	touch $@

# Long tests (marked slow); pytest exits 5 when none are collected.
test-slow: $(BIN)/.installed-dev $(BIN)/.installed-lm-eval
	$(PRELOAD) $(BIN)/pytest -q -m slow || [ $$? -eq 5 ]

lint: $(BIN)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(BIN)/.installed-dev
	$(PRELOAD) $(BIN)/python -m bench.single_stream

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

# capture — two commands for a new user: `make trial` (the staged trial on the built-in tiny
# example, CPU) and `make test` (the test suite). Everything else is documented in README.md.
PY       ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
# CPU build by default; on a GPU machine use the images (make trial-cuda / trial-rocm) or set
# TORCH_SPEC to the build that matches your driver.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suite on up to four worker processes (pytest-xdist, in the dev extra), one test file per worker
# at a time: a file's module fixtures are built once. `make test PYTEST_WORKERS=` runs it in one process.
PYTEST_WORKERS ?= -n auto --maxprocesses=4 --dist loadfile

.PHONY: setup test-setup trial test bench clean

# Two stamps: `make trial` installs what a trial needs (torch, the package with its `trial` extra);
# `make test` adds what the tests need (the `dev` extra) on top, so either order works.
setup: $(VENV)/.installed-trial
test-setup: $(VENV)/.installed-dev

$(VENV)/.installed-trial: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[trial]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-trial
	$(BIN)/pip install -q -e '.[trial,dev]'
	touch $@

trial: setup
	mkdir -p out
	$(BIN)/capture trial --example tiny -o out/trial-tiny.toml
	$(BIN)/capture verify out/trial-tiny.toml
	@echo "capture is installed in $(BIN)/: run it as $(BIN)/capture, or \`. $(BIN)/activate\` first"

test: test-setup
	$(BIN)/pytest -q $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/fingerprint_vs_collect_env.py

clean:
	rm -rf out .pytest_cache

-include images/images.mk

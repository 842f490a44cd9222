# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VPIP := $(VPY) -m pip
# The CPU wheel of torch lies on this machine's disk; pinning it avoids a multi-GB CUDA download.
TORCH_PIN ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: venv dev demo test lint clean

$(VENV)/.base: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q "$(TORCH_PIN)"
	$(VPIP) install -q -e ".[demo]"
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(VPIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.base
dev: $(VENV)/.dev

demo: $(VENV)/.base
	$(VPY) -m shardwise run --nproc-per-node 2 examples/gpt/train.py --out runs/demo

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

# pytest exits 5 when it collects nothing: that is a failure, and `make` treats any non-zero as one.
test: lint
	$(VPY) -m pytest -q --durations=15 tests

clean:
	rm -rf $(VENV) runs .pytest_cache

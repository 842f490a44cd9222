# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VPIP := $(VPY) -m pip
# The CPU wheel of torch lies on this machine's disk; pinning it avoids a multi-GB CUDA download.
TORCH_PIN ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
# Byte-code caching on, whatever the environment says (some containers set
# PYTHONDONTWRITEBYTECODE=1): the suite starts hundreds of processes, and without the cache
# each one compiles shardwise's sources again (0.2 s of CPU a process; 9 % of test_hang.py's
# CPU time). Python reads an empty value as unset.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: venv dev demo test test-fast lint clean bench test-stress test-isa test-hf-457 deepspeed-shim

$(VENV)/.base: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q "$(TORCH_PIN)"
	$(VPIP) install -q -e ".[demo]"
	touch $@

# The tests compare with real DeepSpeed where it runs on CPU (MoE gate statistics, defaults
# read from its signatures), so the test install has the `bench` extra too, and the `lightning`
# and `ray` extras (tests/test_lightning.py, tests/test_ray.py; the torch pin keeps them from
# swapping torch).
$(VENV)/.dev: $(VENV)/.bench
	$(VPIP) install -q -c $(VENV)/bench-constraints.txt -e ".[dev,lightning,ray]"
	touch $@

# The peers the benchmarks measure (DeepSpeed 0.19). The constraint keeps pip from swapping our
# torch for the one DeepSpeed would pick; DS_BUILD_OPS=0: its ops compile on first use, if any.
$(VENV)/.bench: $(VENV)/.base
	printf '%s\n' "$(TORCH_PIN)" > $(VENV)/bench-constraints.txt
	DS_BUILD_OPS=0 $(VPIP) install -q -c $(VENV)/bench-constraints.txt -e ".[bench]"
	touch $@

venv: $(VENV)/.base

# The `deepspeed` distribution answered by shardwise, for the Hugging Face Trainer and Accelerate
# (integrations/deepspeed-shim, docs/deepspeed-compat.md). It refuses a venv holding a real
# DeepSpeed, as the dev venv does (the bench extra): make it in a venv made with `make venv`.
deepspeed-shim: $(VENV)/.base
	$(VPIP) install --no-deps ./integrations/deepspeed-shim
dev: $(VENV)/.dev

# 4 processes: data 2 x pipeline 2 (micro-batch 4 x 4 micro-batches, 32 windows per step).
demo: $(VENV)/.base
	$(VPY) -m shardwise run --nproc-per-node 4 examples/gpt/train.py --dp 2 --pp 2 --micro-batch 4 --out runs/demo

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pytest exits 5 when it collects nothing: that is a failure, and `make` treats any non-zero as one.
# Then the Hugging Face tests again under transformers 4.57 (test-hf-457, below).
test: lint
	$(VPY) -m pytest -q --durations=15 tests
	$(MAKE) test-hf-457

# The fast tier: every test that starts no process (tests/tiers.py), about a minute.
test-fast: $(VENV)/.dev
	$(VPY) -m pytest -q -m "not procs" tests

# The suite beside a CPU burner of twice the cores (tests/scripts/under_load.py): waits
# stretch through tests/waits.py, so a loaded machine makes tests slower, not red.
# ISA=avx2 or ISA=default also caps the vector ISA as test-isa does (both conditions at once).
STRESS_TESTS ?= tests
ISA ?=
test-stress: $(VENV)/.dev
	$(if $(ISA),env $(ISA_$(ISA)) $(VPY) -c "import torch; print('ISA cap $(ISA): torch reports', torch.backends.cpu.get_cpu_capability())")
	env $(ISA_$(ISA)) $(VPY) tests/scripts/under_load.py -- $(VPY) -m pytest -q --durations=15 $(STRESS_TESTS)

# Kernel independence: the suite with the CPU's vector ISA capped, once at AVX2 and once at no
# vector extension, in ATen (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA) and MKL
# (MKL_ENABLE_INSTRUCTIONS). Each run first prints the capability torch reports.
ISA_TESTS ?= tests
ISA_avx2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ISA_default := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-isa: $(VENV)/.dev
	set -e; for isa in avx2 default; do \
	  case $$isa in avx2) caps="$(ISA_avx2)";; default) caps="$(ISA_default)";; esac; \
	  env $$caps $(VPY) -c "import torch; print('ISA cap $$isa: torch reports', torch.backends.cpu.get_cpu_capability())"; \
	  env $$caps $(VPY) -m pytest -q $(ISA_TESTS); \
	done

# DP (ours vs torch DDP vs DeepSpeed stage 0, 2 ranks) then the single-process overhead.
# The first run compiles DeepSpeed's CPU comm op (a minute or two; cached in ~/.cache).
bench: $(VENV)/.bench
	DS_ACCELERATOR=cpu $(VPY) -m shardwise run --nproc-per-node 2 benchmarks/dp.py
	DS_ACCELERATOR=cpu $(VPY) -m shardwise run --nproc-per-node 2 benchmarks/zero.py
	$(VPY) -m shardwise run --nproc-per-node 2 benchmarks/tp_vs_torch.py
	$(VPY) benchmarks/overhead.py

# The Hugging Face tests under transformers 4.57, the oldest release pyproject admits (.venv has
# the newest): a second venv beside .venv, same torch, shardwise installed editable from this
# checkout. `make test` runs it after the main suite, so CI tests both lines.
HF457 := .venv-hf457
HF_TESTS := tests/test_hf_models.py tests/test_hf_pipeline.py tests/test_hf_save.py \
	tests/test_hf_context_parallel.py tests/test_tp_hf.py tests/test_packed_qkv.py \
	tests/test_tp_styles.py
$(HF457)/.base: pyproject.toml
	$(PY) -m venv $(HF457)
	$(HF457)/bin/python -m pip install -q --upgrade pip
	printf '%s\n' "$(TORCH_PIN)" "transformers==4.57.*" > $(HF457)/constraints.txt
	$(HF457)/bin/python -m pip install -q -c $(HF457)/constraints.txt "$(TORCH_PIN)"
	$(HF457)/bin/python -m pip install -q -c $(HF457)/constraints.txt -e ".[hf]" pytest
	touch $@

test-hf-457: $(HF457)/.base
	$(HF457)/bin/python -m pytest -q --durations=10 $(HF_TESTS)

clean:
	rm -rf $(VENV) $(HF457) runs .pytest_cache

# hotswap: make setup | model | demo | test | bench | lint
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch by default; GPU users install their CUDA torch into the venv first.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup model demo test test-fast test-avx2 test-gpu gpu-check bench bench-weight-sync lint

# The C++ kernels are built here, once per version and ISA, so that no Engine start builds them.
setup: $(VENV)/.installed
	$(BIN)/python -m hotswap.engine.layers.cpu_kernels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip show torch >/dev/null 2>&1 || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

model: setup
	$(BIN)/python -m hotswap.engine.models.fetch

demo: model
	$(BIN)/python -m hotswap.rollout.grpo

test: model
	$(BIN)/python -m pytest -q -ra

test-fast: setup
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

# The fast tests on the code paths of an AVX2-only CPU, on any x86 CPU (docs/cpu.md): hotswap's
# checks and kernels, torch's and oneDNN's kernels all capped at AVX2.
AVX2_ENV := HOTSWAP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	MKL_ENABLE_INSTRUCTIONS=AVX2
test-avx2: setup
	$(AVX2_ENV) $(BIN)/python -m hotswap.engine.layers.cpu_kernels
	$(AVX2_ENV) $(BIN)/python -m pytest -q -ra -m "not real_model and not slow"

# On a CUDA machine with triton and flashinfer installed: the kernel checks skipped on CPU.
test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# On a CUDA machine: gpu tests, bf16 throughput per attention backend vs HF, an NCCL weight
# update vs a raw broadcast; one JSON file (docs/gpu.md). Unattended, under 8 minutes.
gpu-check: model
	$(BIN)/python bench/gpu_check.py --out gpu_check.json

bench: model
	$(BIN)/python bench/throughput.py

bench-weight-sync: model
	$(BIN)/python bench/weight_sync.py

lint: setup
	$(BIN)/ruff check .

# verl's own trainer, two GRPO steps on CPU with hotswap rolling out (docs/rl.md#hotswap-in-verl).
# verl pins transformers<5.11, so it gets its own virtualenv; 5-6 minutes (warm pip cache).
VERL_VENV ?= .venv-verl
.PHONY: test-verl

$(VERL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip show torch >/dev/null 2>&1 || $(VERL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VERL_VENV)/bin/python -m pip install -q -e ".[verl]"
	touch $@

test-verl: model $(VERL_VENV)/.installed
	$(VERL_VENV)/bin/python examples/verl/grpo_cpu.py --check

# opsnn_lab: every target sets itself up (virtual environment, pinned CPU torch, the package).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch is installed first so the package's own `torch>=2.4` pulls nothing more.
# Elsewhere: make TORCH_SPEC=torch==2.13.0 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.opsnn-installed
PYTEST_ARGS ?=
# Second pass of `make test`: the numerics-sensitive suites (bitwise checks) and the notebooks as a CPU one
# step below this one runs them (scripts/isa_below_host.sh: AVX2 on an AVX-512 host, SSE on an AVX2 host),
# so it always runs kernels the first pass did not. ISA_ENV="ATEN_CPU_CAPABILITY=avx2 ..." picks the
# variables; ISA_ENV= skips the pass.
ISA_ENV ?= $$(bash scripts/isa_below_host.sh)
ISA_TESTS ?= tests/consistency tests/kernels/test_rng.py tests/ops
NBVAL := -p no:cacheprovider --nbval-lax --nbval-sanitize-with tests/notebooks/sanitize.cfg \
	--nbval-cell-timeout 600 -o addopts="" -o testpaths="" notebooks/

.PHONY: setup test demo lab bench lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e ".[notebooks,triton,dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(STAMP)

test: setup
	bash scripts/ensure_chromium.sh
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest --durations=20 $(PYTEST_ARGS)
	$(BIN)/python -m pytest $(NBVAL)
ifneq ($(strip $(ISA_ENV)),)
	@echo "second pass as another CPU: $(ISA_ENV)"
	env $(ISA_ENV) $(BIN)/python -m pytest -m "not distributed and not browser" $(ISA_TESTS)
	env $(ISA_ENV) $(BIN)/python -m pytest $(NBVAL)
endif

demo: setup
	$(BIN)/python -m opsnn_lab.report

lab: setup
	$(BIN)/jupyter lab notebooks/

bench: setup
	$(BIN)/python -m opsnn_lab.bench all

lint: setup
	$(BIN)/python -m ruff check .

clean:
	rm -rf build

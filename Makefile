# Everything here installs what it needs from nothing: a fresh clone and python3 suffice.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all demo docs lint typecheck bench bench-backends bench-mislabeled gpu-wheels clean

$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Every phase (the main run; the convolution rules with oneDNN on, then off; the JAX
# backend) runs to its end and a table reports each; .ci/phases says more. `make test`
# leaves out the cases marked `extended`, `make test-all` runs them too.
# PYTEST_ARGS go to every phase: PYTEST_ARGS=--shuffle runs each in a random order.
PYTEST_ARGS ?=

test: $(STAMP)
	.ci/phases $(PY) -m "not extended" $(PYTEST_ARGS)

test-all: $(STAMP)
	.ci/phases $(PY) $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check keras_gradtrack tests benchmarks
	$(PY) -m ruff format --check keras_gradtrack tests benchmarks

typecheck: $(STAMP)
	$(PY) -m mypy

# The demo installs only what it runs: the package, scikit-learn's digits, the plots and
# TensorBoard's event files (not the development set of `install`).
DEMO_STAMP := $(VENV)/.installed-demo

$(DEMO_STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e ".[demo,plots,tensorboard]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m keras_gradtrack.demo --out demo_output

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# Both backends' tables (TensorFlow, JAX), each in a process of its own.
bench-backends: $(STAMP)
	$(PY) benchmarks/backends.py

bench-mislabeled: $(STAMP)
	$(PY) benchmarks/mislabeled_digits.py

# LESS-style data selection from LoRA gradient sketches (keras_hub GPT-2, about a minute).
.PHONY: bench-data-selection
bench-data-selection: $(STAMP)
	$(PY) benchmarks/data_selection.py

# What benchmarks/gpu/run.sh installs on a machine without network: the project's wheel
# and the pure-Python (and cp312 manylinux) wheels of Keras and its dependencies that
# a machine with JAX, h5py and numpy lacks, at the tested versions.
GPU_WHEELS := benchmarks/gpu/wheels
GPU_WHEEL_PACKAGES := keras optree absl-py rich namex markdown-it-py mdurl pygments packaging typing_extensions
# keras_hub (without TensorFlow Text) and what it imports on JAX, for the causal LMs of
# benchmarks/long_sequence.py.
GPU_WHEEL_PACKAGES += keras-hub kagglehub kagglesdk protobuf regex sentencepiece tokenizers \
	pyyaml requests urllib3 idna certifi charset-normalizer tqdm
# Opacus (pure Python) for the torch table beside it (it imports the machine's scipy).
GPU_WHEEL_PACKAGES += opacus opt_einsum

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --dest $(GPU_WHEELS) \
		--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-c .ci/constraints.txt $(GPU_WHEEL_PACKAGES)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(GPU_WHEELS) .
	du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) demo_output .pytest_cache .ruff_cache .mypy_cache

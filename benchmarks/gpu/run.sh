#!/usr/bin/env bash
# The JAX overhead benchmark on a machine with an NVIDIA GPU, JAX with CUDA, h5py and
# numpy, without TensorFlow and without network.
#
# Prepare the wheels here first, on a machine with network: `make gpu-wheels`
# (benchmarks/gpu/wheels: the project and Keras' pure-Python dependencies, ~5 MiB).
# Then, on the GPU machine, from a copy of the repository:
#
#   bash benchmarks/gpu/run.sh [table.md]
#
# It makes a virtual environment that sees the machine's packages (jax[cuda], h5py,
# numpy), installs what is missing from the wheels only, checks that JAX sees the GPU,
# and runs benchmarks/jax_overhead.py on mlp, cnn and transformer at B=128 and 512
# (ms/step of plain and tracked fit, their ratio, peak GPU memory), writing the
# markdown table to the file given (default benchmarks/gpu/results-<time>.md); then
# benchmarks/long_sequence.py's causal LMs (GPT-2, Qwen3) at T = 128 to 4096 on JAX,
# its table to the same name with `-long-sequence` before `.md`; then, where the machine
# has PyTorch, benchmarks/torch_overhead.py (Keras on PyTorch beside Opacus) to `-torch`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$HERE/.venv}"
WHEELS="$HERE/wheels"
OUT="${1:-$HERE/results-$(date -u +%Y%m%dT%H%M%S).md}"

if ! ls "$WHEELS"/keras_gradtrack-*.whl >/dev/null 2>&1; then
    echo "No wheels in $WHEELS: run 'make gpu-wheels' on a machine with network first." >&2
    exit 1
fi
if "$PYTHON" -m venv --system-site-packages "$VENV" 2>/dev/null; then
    PY="$VENV/bin/python"
    TARGET=()
else
    # No venv module on this machine: install into a folder put on the path instead.
    PY="$PYTHON"
    TARGET=(--target "$HERE/site-packages")
    export PYTHONPATH="$HERE/site-packages${PYTHONPATH:+:$PYTHONPATH}"
fi
# Keras and what it needs beyond the machine's packages, from the wheels only.
"$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${TARGET[@]}" \
    keras optree absl-py rich namex
# keras_hub without TensorFlow Text and tokenizers without the Hugging Face Hub (neither
# is imported on JAX), then what keras_hub imports.
"$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "${TARGET[@]}" \
    keras-hub tokenizers
"$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${TARGET[@]}" \
    kagglehub kagglesdk protobuf regex sentencepiece pyyaml requests tqdm
# The project without its TensorFlow dependency (the JAX engine imports none).
"$PY" -m pip install --quiet --no-index --no-deps --force-reinstall "${TARGET[@]}" \
    "$WHEELS"/keras_gradtrack-*.whl

export KERAS_BACKEND=jax
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the allocator's peak is then the models' own
"$PY" - <<'PYTHON'
import sys

import jax

devices = jax.devices()
print("JAX", jax.__version__, devices)
if devices[0].platform != "gpu":
    sys.exit("JAX sees no GPU: install jax with CUDA (jax[cuda12]) on this machine.")
PYTHON

cd "$ROOT"
"$PY" benchmarks/jax_overhead.py --models mlp,cnn,transformer --batch-sizes 128,512 \
    --rounds 3 --seconds 1.0 --out "$OUT"
echo "Table written to $OUT"
LONG_OUT="${OUT%.md}-long-sequence.md"
"$PY" benchmarks/long_sequence.py --backends jax --seq-lens 128,512,1024,2048,4096 \
    --variants tracked,norms \
    --out "$LONG_OUT"
echo "Table written to $LONG_OUT"
# Keras on PyTorch (the machine's torch with CUDA) beside Opacus, where the wheels hold it.
TORCH_OUT="${OUT%.md}-torch.md"
if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "${TARGET[@]}" \
        opacus || echo "No Opacus wheel: the torch table leaves its columns out." >&2
    KERAS_BACKEND=torch "$PY" benchmarks/torch_overhead.py --batch-sizes 128,512 --rounds 3 \
        --out "$TORCH_OUT"
    echo "Table written to $TORCH_OUT"
fi

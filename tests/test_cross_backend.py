"""The same model, weights and data give the same log on TensorFlow, JAX and PyTorch.

tests/cross_backend_worker.py runs every case of tests/cross_backend_models.py once per
backend, each in a process of its own (Keras picks its backend when imported): first on
TensorFlow, which saves each model's first weights, then on JAX and on PyTorch, which
load them (`.weights.h5`; one case the whole `.keras` model). Each run fits 3 steps of 8 examples
in order with `HDF5GradientLogger`'s default statistics. Every dataset of the two logs
(the per-example and per-step columns, per layer too, the layer names) and every weight
after the steps (the optimizer's too) must agree, by the oracle's tolerance rule
(tests/tolerance.py: rtol 1e-4 in float32); every attribute too, but those that name
the run (DIFFERING_ATTRIBUTES). The same workers run every `keras_gradtrack.autodiff`
function on one model from TensorFlow's weights; each result must agree too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from cross_backend_models import CASES
from tolerance import FLOOR, tolerance

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "cross_backend_worker.py"
BACKENDS = ("tensorflow", "jax", "torch")

# Attributes of the log that name the run, not its numbers: {object path: names}.
DIFFERING_ATTRIBUTES = {"/": {"backend", "created"}}


class RefusedOnJax(Exception):
    """The JAX run of a case was refused (a feature the JAX engine lacks today)."""


class RefusedOnTorch(Exception):
    """The PyTorch run of a case was refused (a feature the PyTorch engine lacks today)."""


def differs(reason: str) -> Any:
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


EXPECTED_FAILURES = {
    "dropout_in_training": differs(
        "Keras draws dropout masks with each backend's own random generator, seeds alike"
    ),
    "embedding_adam": differs(
        "plain Keras' Adam updates an Embedding differently: on TensorFlow its gradient is "
        "an IndexedSlices and the moments change only at the batch's rows (plain "
        "keras.Model, same weights, differs the same way)"
    ),
}


# Cases whose features others here cover, run by `make test-all` only: every convolution
# and normalization rule (each layer's rule is held to the oracle on both backends),
# example ids, Adam on an Embedding and dropout (both expected to differ), adaptive
# clipping and a loss scale (the private step is `private`'s).
EXTENDED = {
    "separable_cnn",
    "mlp_example_ids",
    "embedding_adam",
    "dropout_in_training",
    "private_adaptive",
    "private_loss_scale",
}


def run_worker(backend: str, out: Path, *arguments: str) -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, str(WORKER), str(out), *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, f"{backend} worker failed:\n{result.stderr[-4000:]}"


def selected_cases(request: pytest.FixtureRequest) -> list[str]:
    """The cases of this module's tests that this session runs, and `mlp_sgd`."""
    names = {"mlp_sgd"}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and "case" in getattr(callspec, "params", {}):
            names.add(callspec.params["case"])
    return [name for name in CASES if name in names]


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Each backend's output folder, with the cases this session runs (and `mlp_sgd`);
    JAX's and PyTorch's models start from TensorFlow's weights."""
    cases = ",".join(selected_cases(request))
    out = tmp_path_factory.mktemp("cross_backend")
    run_worker("tensorflow", out / "tensorflow", "--cases", cases)
    for backend in BACKENDS[1:]:
        weights = str(out / "tensorflow")
        run_worker(backend, out / backend, "--weights-from", weights, "--cases", cases)
    return {backend: out / backend for backend in BACKENDS}


def contents(file: h5py.File) -> dict[str, Any]:
    """`{path: group or dataset}` of every object in `file`, the root as "/"."""
    found: dict[str, Any] = {"/": file}

    def add(name: str, item: Any) -> None:  # a value other than None stops the visit
        found[name] = item

    file.visititems(add)
    assert len(found) > 1, f"{file.filename} is empty"
    return found


def assert_same_attributes(path: str, got: Any, want: Any) -> None:
    ignored = DIFFERING_ATTRIBUTES.get(path, set())
    names = set(want.attrs) - ignored
    assert set(got.attrs) - ignored == names, f"{path}: attributes"
    for name in sorted(names):
        a, b = np.asarray(got.attrs[name]), np.asarray(want.attrs[name])
        same = a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        assert same, f"{path}.attrs[{name}]: {a} != {b}"


def assert_same_values(path: str, got: Any, want: Any, atol: float | None = None) -> None:
    """Integers exactly, floats by the tolerance rule (`atol`: the floor to use)."""
    assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=path)
        return
    rtol, floor = tolerance(path.rsplit("/", 1)[-1], want)
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=rtol,
        atol=floor if atol is None else atol,
        err_msg=path,
    )


def assert_same_log(got: Path, want: Path) -> None:
    with h5py.File(got, "r") as got_file, h5py.File(want, "r") as want_file:
        got_items, want_items = contents(got_file), contents(want_file)
        assert sorted(got_items) == sorted(want_items)
        for path, want_item in want_items.items():
            got_item = got_items[path]
            assert_same_attributes(path, got_item, want_item)
            if isinstance(want_item, h5py.Dataset):
                assert got_item.dtype == want_item.dtype, f"{path}: dtype"
                assert_same_values(path, got_item[()], want_item[()])


def assert_same_weights(got: Path, want: Path) -> None:
    """Every variable of the model and the optimizer; the floor is of each group's
    scale (a gradient of exactly zero, as the attention's key bias has, leaves
    rounding residue of the other weights' scale)."""
    with h5py.File(got, "r") as got_file, h5py.File(want, "r") as want_file:
        got_items, want_items = contents(got_file), contents(want_file)
        assert sorted(got_items) == sorted(want_items)
        datasets = {p: d[()] for p, d in want_items.items() if isinstance(d, h5py.Dataset)}
        scale: dict[str, float] = {}
        for path, values in datasets.items():
            group = path.split("/", 1)[0]
            if values.dtype.kind == "f" and values.size:
                scale[group] = max(scale.get(group, 0.0), float(np.abs(values).max()))
        for path, values in datasets.items():
            # The optimizer's step counter is int64 on TensorFlow, int32 on JAX.
            atol = FLOOR * scale.get(path.split("/", 1)[0], 0.0)
            assert_same_values(path, got_items[path][()], values, atol=atol)


# What differs on PyTorch as on JAX (nothing is refused there: a refusal would fail the
# case with RefusedOnTorch).
TORCH_EXPECTED = {
    "dropout_in_training": EXPECTED_FAILURES["dropout_in_training"],
    "embedding_adam": EXPECTED_FAILURES["embedding_adam"],
}
EXPECTED = {"jax": EXPECTED_FAILURES, "torch": TORCH_EXPECTED}
REFUSED = {"jax": RefusedOnJax, "torch": RefusedOnTorch}


@pytest.mark.parametrize(
    ("backend", "case"),
    [
        pytest.param(
            backend,
            name,
            marks=[
                *([EXPECTED[backend][name]] if name in EXPECTED[backend] else []),
                *([pytest.mark.extended] if name in EXTENDED else []),
            ],
            id=f"{backend}-{name}",
        )
        for backend in BACKENDS[1:]
        for name in CASES
    ],
)
def test_the_same_log_and_weights_as_on_tensorflow(
    runs: dict[str, Path], backend: str, case: str
) -> None:
    tensorflow, other = runs["tensorflow"] / case, runs[backend] / case
    results = [json.loads((folder / "result.json").read_text()) for folder in (tensorflow, other)]
    assert results[0]["error"] is None, f"on TensorFlow: {results[0].get('traceback')}"
    if results[1]["error"] is not None:
        raise REFUSED[backend](results[1]["error"])
    # The run started from the weights the TensorFlow run wrote.
    assert Path(results[1]["weights_from"]).parent == tensorflow
    assert_same_log(other / "log.h5", tensorflow / "log.h5")
    assert_same_weights(other / "final.weights.h5", tensorflow / "final.weights.h5")


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_autodiff_gives_the_same_results_as_on_tensorflow(
    runs: dict[str, Path], backend: str
) -> None:
    """Every `keras_gradtrack.autodiff` function on the worker's Conv1D model, from
    TensorFlow's weights, by the tolerance rule."""
    with (
        np.load(runs["tensorflow"] / "autodiff" / "results.npz") as want,
        np.load(runs[backend] / "autodiff" / "results.npz") as got,
    ):
        assert sorted(got.files) == sorted(want.files)
        assert len(want.files) == 13  # 5 functions, 2 x 4 variables
        for name in want.files:
            assert_same_values(name, got[name], want[name])


def test_the_differing_attributes_name_the_backends(runs: dict[str, Path]) -> None:
    for backend in BACKENDS:
        with h5py.File(runs[backend] / "mlp_sgd" / "log.h5", "r") as log:
            assert log.attrs["backend"] == backend
            assert str(log.attrs["created"]).startswith("20")

"""Streamed columns: large tensors written part by part, visible only once their step is."""

import h5py
import numpy as np
import pytest
from helpers_io import ATTRS

from keras_gradtrack.io import BlockWriter
from keras_gradtrack.io.output_schema import OutputGradientLayout

LAYOUT = OutputGradientLayout(
    ["dense", "head"], 5, -1, {"dense": {"kernel": (3, 4), "bias": (4,)}}, chunk_size=2
)
KERNEL = OutputGradientLayout.tensor_path("dense", "kernel")
BIAS = OutputGradientLayout.tensor_path("dense", "bias")


def rows(epoch, norms):
    return {"per_step": {"epoch": epoch, "output_grad_norm": norms}}


def write_step(writer, step, kernel, bias, norms):
    with writer.streamed_step(step) as parts:
        for start in (0, 2, 4):
            chunk = slice(start, min(start + 2, 5))
            parts.write_part(KERNEL, chunk, kernel[chunk])
            parts.write_part(BIAS, chunk, bias[chunk])
        parts.set_rows(rows(0, norms))


def table_lengths(path):
    with h5py.File(path, "r", swmr=True) as file:
        return {name: file[name].shape[0] for name in ("per_step/step", KERNEL, BIAS)}


def test_a_streamed_step_is_visible_once_complete_and_never_as_garbage(tmp_path):
    path = tmp_path / "features.h5"
    rng = np.random.default_rng(0)
    kernel, bias, norms = rng.normal(size=(5, 3, 4)), rng.normal(size=(5, 4)), rng.random((5, 2))
    with BlockWriter(path, LAYOUT, attrs=ATTRS) as writer:
        write_step(writer, 0, kernel, bias, norms)
        with writer.streamed_step(3) as parts:
            parts.write_part(KERNEL, slice(0, 2), kernel[:2])
            # Mid-step: the step column has not grown; the new tensor row is fill values.
            with h5py.File(path, "r", swmr=True) as file:
                assert file["per_step/step"][:].tolist() == [0]
                assert file[KERNEL].shape == (2, 5, 3, 4)
                assert np.isnan(file[KERNEL][1, 2:]).all() and np.isnan(file[BIAS][1]).all()
            parts.write_part(KERNEL, slice(2, 5), kernel[2:])
            parts.write_part(BIAS, slice(0, 5), bias)
            parts.set_rows(rows(1, norms))
    with h5py.File(path, "r") as file:
        assert file["per_step/step"][:].tolist() == [0, 3]
        assert file["per_step/epoch"][:].tolist() == [0, 1]
        np.testing.assert_allclose(file[KERNEL][1], kernel.astype(np.float32))
        np.testing.assert_allclose(file["per_step/output_grad_norm"][1], norms.astype(np.float32))
        assert file[KERNEL].chunks == (1, 2, 3, 4)
        assert file.attrs["output_gradients_schema_version"] == 1
        assert (file.attrs["num_features"], file.attrs["axis"]) == (5, -1)


def test_a_step_that_fails_half_way_leaves_nothing_behind(tmp_path):
    path = tmp_path / "features.h5"
    kernel, bias, norms = np.ones((5, 3, 4)), np.ones((5, 4)), np.ones((5, 2))
    with BlockWriter(path, LAYOUT, attrs=ATTRS) as writer:
        write_step(writer, 0, kernel, bias, norms)
        with pytest.raises(ZeroDivisionError), writer.streamed_step(1) as parts:
            parts.write_part(KERNEL, slice(0, 2), kernel[:2])
            _ = 1 / 0  # the gradient computation fails
        assert table_lengths(path) == {"per_step/step": 1, KERNEL: 1, BIAS: 1}
        with pytest.raises(RuntimeError, match="set_rows"), writer.streamed_step(1) as parts:
            parts.write_part(KERNEL, slice(0, 5), kernel)
        with pytest.raises(ValueError, match="streamed column"), writer.streamed_step(1) as parts:
            parts.write_part("per_step/output_grad_norm", slice(0, 5), norms)
        write_step(writer, 1, kernel, bias, norms)
    assert table_lengths(path) == {"per_step/step": 2, KERNEL: 2, BIAS: 2}


def test_appending_to_an_output_gradient_log_checks_its_layout(tmp_path):
    path = tmp_path / "features.h5"
    kernel, bias, norms = np.ones((5, 3, 4)), np.ones((5, 4)), np.ones((5, 2))
    with BlockWriter(path, LAYOUT, attrs=ATTRS) as writer:
        write_step(writer, 0, kernel, bias, norms)
    other = OutputGradientLayout(["dense", "head"], 6, -1, {})
    with pytest.raises(ValueError, match=r"its num_features differ.*Received: num_features=6"):
        BlockWriter(path, other, attrs=ATTRS, append=True).open()
    with BlockWriter(path, LAYOUT, attrs=ATTRS, append=True) as writer:
        assert writer.step_offset == 1
        write_step(writer, 0, kernel, bias, norms)
    assert table_lengths(path) == {"per_step/step": 2, KERNEL: 2, BIAS: 2}

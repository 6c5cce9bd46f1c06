"""`OutputGradientLogger`: per-output-feature weight gradients during `fit`, streamed to HDF5."""

from __future__ import annotations

import datetime
import os
from typing import Any

import h5py
import keras
import numpy as np
import tensorflow as tf

from keras_gradtrack import autodiff
from keras_gradtrack.engine.plan import layers_with_own_variables
from keras_gradtrack.io.writer import LogWriter
from keras_gradtrack.rules.ops import sum_of_squares
from keras_gradtrack.version import __version__

OUTPUT_GRADIENTS_SCHEMA_VERSION = 1


class OutputGradientLogger(keras.callbacks.Callback):
    """Logs, every `every_n_steps`, the weight gradient of each output feature.

    For each feature `f` along `axis` of `model(x)` (on the fixed input `x`
    given here) and each layer, it writes the norm of
    `d sum(output[..., f]) / d W_layer` to `/per_step/output_grad_norm`, shape
    `(steps, features, layers)`. With `save_tensors=True` it also writes the
    full per-feature gradients to `/output_gradients/<layer>/<variable>`,
    shape `(steps, features) + variable.shape`. Features are processed
    `chunk_size` at a time and each chunk is written as it is computed, so
    memory grows with the chunk, never with the number of features.

    Args:
        path: The `.h5` file to write (its own file: one writer per file).
        x: The input batch the output gradients are taken at.
        every_n_steps: Log one training step in every `every_n_steps`.
        axis: The output axis that enumerates the features.
        chunk_size: Features per compiled gradient call.
        save_tensors: Also store the full per-feature gradient tensors.
        overwrite: Replace an existing file.

    Example:

    ```python
    logger = kgt.OutputGradientLogger("features.h5", x_probe, every_n_steps=50)
    model.fit(x, y, callbacks=[logger])
    with h5py.File("features.h5", "r", swmr=True) as f:
        norms = f["per_step/output_grad_norm"][:]   # (steps, features, layers)
    ```
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x: Any,
        every_n_steps: int = 100,
        axis: int = -1,
        chunk_size: int = 16,
        save_tensors: bool = False,
        overwrite: bool = False,
    ):
        super().__init__()
        for name, value in (("every_n_steps", every_n_steps), ("chunk_size", chunk_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Expected `{name}` to be a positive int. Received: {value!r}")
        self.path = os.fspath(path)
        self.x = x
        self.every_n_steps = every_n_steps
        self.axis = axis
        self.chunk_size = chunk_size
        self.save_tensors = save_tensors
        self.overwrite = overwrite
        self.file: h5py.File | None = None
        self._output_gradients: autodiff.OutputGradients | None = None
        self._step = 0
        self._epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        LogWriter.check_path(self.path, overwrite=self.overwrite, append=False)
        self._step = 0
        self._groups = [(layer.name, own) for layer, own in layers_with_own_variables(self.model)]
        self._variables = [v for _, group in self._groups for v in group]
        output = self.model(self.x)
        rank = len(output.shape)
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"`axis` must index the model's output of shape {tuple(output.shape)}. "
                f"Received: axis={self.axis}"
            )
        self._num_features = int(output.shape[self.axis])
        self._open()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Before the step's update: the weights this step starts from, as for the
        # per-example statistics of a tracked step.
        if self._step % self.every_n_steps == 0:
            self._write_step()
        self._step += 1

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.close()

    def close(self) -> None:
        """Closes the file (idempotent)."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def _open(self) -> None:
        features, layers = self._num_features, len(self._groups)
        self.file = h5py.File(self.path, "w", libver=("v110", "latest"))
        f = self.file
        f.attrs.update(
            {
                "output_gradients_schema_version": OUTPUT_GRADIENTS_SCHEMA_VERSION,
                "library_version": __version__,
                "keras_version": keras.__version__,
                "tensorflow_version": tf.__version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "model_name": self.model.name,
                "num_features": features,
                "axis": self.axis,
            }
        )
        f.create_group("layers").attrs["names"] = [name for name, _ in self._groups]
        steps = f.create_group("per_step")
        steps.create_dataset("step", (0,), "int64", maxshape=(None,), chunks=(256,))
        steps.create_dataset("epoch", (0,), "int32", maxshape=(None,), chunks=(256,))
        steps.create_dataset(
            "output_grad_norm",
            (0, features, layers),
            "float32",
            maxshape=(None, features, layers),
            chunks=(1, features, layers),
            compression="gzip",
        )
        if self.save_tensors:
            tensors = f.create_group("output_gradients")
            for name, group in self._groups:
                layer_group = tensors.create_group(name)
                for variable in group:
                    shape = tuple(variable.shape)
                    layer_group.create_dataset(
                        variable.name,
                        (0, features, *shape),
                        "float32",
                        maxshape=(None, features, *shape),
                        chunks=(1, min(self.chunk_size, features), *shape),
                        compression="gzip",
                    )
        f.swmr_mode = True

    def _stream(self) -> Any:
        """`autodiff.output_gradients`, compiled once and reused across steps."""
        if self._output_gradients is None:
            self._output_gradients = autodiff.OutputGradients(
                self.model, self._variables, self.axis, self.chunk_size
            )
        return self._output_gradients(self.x)

    def _datasets(self) -> list[h5py.Dataset]:
        assert self.file is not None
        found = [self.file["per_step/step"], self.file["per_step/epoch"]]
        found.append(self.file["per_step/output_grad_norm"])
        if self.save_tensors:
            found += [
                self.file[f"output_gradients/{name}/{v.name}"]
                for name, group in self._groups
                for v in group
            ]
        return found

    def _write_step(self) -> None:
        assert self.file is not None
        row = self.file["per_step/step"].shape[0]
        for dataset in self._datasets():
            dataset.resize(row + 1, axis=0)
        norms = np.full((self._num_features, len(self._groups)), np.nan, np.float32)
        for features, grads in self._stream():
            position = 0
            for column, (name, group) in enumerate(self._groups):
                layer_grads = grads[position : position + len(group)]
                position += len(group)
                squares = [
                    sum_of_squares(tf.reshape(g, [len(features), -1]), axis=1) for g in layer_grads
                ]
                norms[features, column] = np.sqrt(np.asarray(tf.add_n(squares)))
                if self.save_tensors:
                    for variable, gradient in zip(group, layer_grads):
                        dataset = self.file[f"output_gradients/{name}/{variable.name}"]
                        dataset[row, features[0] : features[-1] + 1] = np.asarray(gradient)
        self.file["per_step/output_grad_norm"][row] = norms
        self.file["per_step/step"][row] = self._step
        self.file["per_step/epoch"][row] = self._epoch
        self.file.flush()

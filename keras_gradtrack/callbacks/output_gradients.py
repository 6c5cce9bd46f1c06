"""`OutputGradientLogger`: per-output-feature weight gradients during `fit`, streamed to HDF5."""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from keras_gradtrack.callbacks.base import FileLogger, check_positive_counts, is_chief, log_attrs
from keras_gradtrack.io import output_schema, schema
from keras_gradtrack.io.block_writer import BlockWriter


class OutputGradientLogger(FileLogger):
    """Logs, every `every_n_steps`, the weight gradient of each output feature.

    For each feature `f` along `axis` of `model(x)` (on the fixed input `x`
    given here) and each layer, it writes the norm of
    `d sum(output[..., f]) / d W_layer` to `/per_step/output_grad_norm`, shape
    `(steps, features, layers)`. With `save_tensors=True` it also writes the
    full per-feature gradients to `/output_gradients/<layer>/<variable>`,
    shape `(steps, features) + variable.shape`. Features are processed
    `chunk_size` at a time and each chunk is written as it is computed, so
    memory grows with the chunk, never with the number of features.

    The file is written like the gradient log (docs/schema.md): made under a
    hidden name and moved into place in SWMR mode, every logged step flushed as
    one block, so a reader (`h5py.File(path, "r", swmr=True)`) sees each step once
    it is complete. Under a multi-worker strategy only the chief writes.

    Args:
        path: The `.h5` file to write.
        x: The input batch the output gradients are taken at.
        every_n_steps: Log one training step in every `every_n_steps`.
        axis: The output axis that enumerates the features.
        chunk_size: Features per compiled gradient call.
        save_tensors: Also store the full per-feature gradient tensors.
        overwrite: Replace an existing file.
        append: Continue an existing log of the same model, features and axis
            (step numbers continue after its last).
        compression: HDF5 compression filter (`"gzip"`, `"lzf"` or None).

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
        append: bool = False,
        compression: str | None = "gzip",
    ):
        check_positive_counts((("every_n_steps", every_n_steps), ("chunk_size", chunk_size)))
        super().__init__(path, append=append, overwrite=overwrite)
        self.x = x
        self.every_n_steps = every_n_steps
        self.axis = axis
        self.chunk_size = chunk_size
        self.save_tensors = save_tensors
        self.compression = compression
        self._gradients: Any = None  # autodiff.OutputGradients
        self._step = 0
        self._epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # Keras calls no on_train_end when a fit stops with an exception; every
        # logged step is already in the file, and this fit continues it.
        self.close()
        self._step = 0
        steps = getattr(self.model, "steps_per_execution", 1)
        if steps > 1:
            raise ValueError(
                f"{type(self).__name__} computes its gradients before each step, from "
                "Python, so it needs `steps_per_execution=1` in `compile()`. "
                f"Received: steps_per_execution={steps}"
            )
        if not is_chief(self.model):
            return
        BlockWriter.check_path(self.path, overwrite=self.overwrite, append=self.append)
        self._groups = [(layer.name, own) for layer, own in output_columns(self.model)]
        output = self.model(self.x)
        rank = len(output.shape)
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"`axis` must index the model's output of shape {tuple(output.shape)}. "
                f"Received: axis={self.axis}"
            )
        variables = [v for _, group in self._groups for v in group]
        self._gradients = feature_gradients(self.model, variables, self.axis, self.chunk_size)
        self._num_features = int(output.shape[self.axis])
        layout = output_schema.OutputGradientLayout(
            [name for name, _ in self._groups],
            self._num_features,
            self.axis,
            self._tensor_shapes() if self.save_tensors else {},
            self.chunk_size,
        )
        self.writer = BlockWriter(
            self.path,
            layout,
            attrs=log_attrs(self.model),
            overwrite=self.overwrite,
            append=self.append,
            compression=self.compression,
        )
        self.writer.open()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Before the step's update: the weights this step starts from, as for the
        # per-example statistics of a tracked step.
        if self.writer is not None and self._step % self.every_n_steps == 0:
            self._write_step()
        self._step += 1

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.close()

    def _tensor_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        shapes = {}
        for layer, variables in self._groups:
            shapes[layer] = {v.name: tuple(v.shape) for v in variables}
            if len(shapes[layer]) != len(variables):
                raise ValueError(
                    "save_tensors=True stores each variable under its name, so the variables "
                    f"of a layer need distinct names. Received: layer {layer!r} with variables "
                    f"{[v.name for v in variables]}"
                )
        return shapes

    def _write_step(self) -> None:
        assert self.writer is not None and self._gradients is not None
        norms = np.full((self._num_features, len(self._groups)), np.nan, dtype=np.float32)
        with self.writer.streamed_step(self._step) as step:
            for features, grads in self._gradients(self.x):
                chunk = slice(int(features[0]), int(features[-1]) + 1)
                position = 0
                for column, (layer, variables) in enumerate(self._groups):
                    layer_grads = grads[position : position + len(variables)]
                    position += len(variables)
                    squares = [
                        np.sum(
                            np.square(keras.ops.convert_to_numpy(g).reshape(len(features), -1)),
                            axis=1,
                        )
                        for g in layer_grads
                    ]
                    norms[chunk, column] = np.sqrt(np.sum(squares, axis=0))
                    if self.save_tensors:
                        for variable, gradient in zip(variables, layer_grads):
                            path = output_schema.OutputGradientLayout.tensor_path(
                                layer, variable.name
                            )
                            step.write_part(path, chunk, keras.ops.convert_to_numpy(gradient))
            step.set_rows(
                {schema.PER_STEP_GROUP: {schema.EPOCH: self._epoch, schema.OUTPUT_GRAD_NORM: norms}}
            )


def output_columns(model: Any) -> list[tuple[Any, list[Any]]]:
    """`(layer, its own trainable variables)` per column of the log."""
    if keras.backend.backend() == "tensorflow":
        from keras_gradtrack.engine.plan import layers_with_own_variables

        return layers_with_own_variables(model)
    from keras_gradtrack.backends.ops import output_gradients

    return output_gradients.output_columns(model)


def feature_gradients(model: Any, variables: list[Any], axis: int, chunk_size: int) -> Any:
    """What streams each chunk's `(features, grads)`: `autodiff.OutputGradients` at the
    values the model holds (on JAX, `fit` keeps them in its state: synced first)."""
    from keras_gradtrack import autodiff

    gradients = autodiff.OutputGradients(model, variables, axis, chunk_size)
    if keras.backend.backend() != "jax":
        return gradients

    def synced(x: Any) -> Any:
        model.jax_state_sync()
        return gradients(x)

    return synced

"""`OutputGradients` on TensorFlow: weight gradients per feature, compiled once (`output_gradients` in `__init__.py` calls it)."""

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_gradtrack.autodiff.arguments import FeatureGradientSettings, check_feature_axis
from keras_gradtrack.autodiff.basis import basis_vjps
from keras_gradtrack.autodiff.checks import (
    as_tensors,
    check_single_output,
    explaining_numpy_round_trips,
)
from keras_gradtrack.autodiff.functions import traced_graph


class OutputGradients(FeatureGradientSettings):
    """`output_gradients` compiled once, for repeated use on inputs of one shape.

    Calling it with `x` yields exactly what `output_gradients(model, x, ...)`
    yields. The compiled function is traced on the first call and reused by
    every later call with inputs of the same shapes and dtypes, so a training
    loop can take output gradients every few steps without tracing again. The
    variables are read at every call: their current values are used.

    Its arguments are `output_gradients`' without `x`, which each call takes.
    Without `variables`, the model must be built: its `trainable_variables` are
    read here.

    Example:

    ```python
    # model: the one of output_gradients' example (144 output features)
    feature_gradients = keras_gradtrack.autodiff.OutputGradients(model, chunk_size=8)
    for step in range(3):
        x = np.random.rand(16, 64, 16).astype("float32")
        for features, grads in feature_gradients(x):  # traced at step 0 only
            kernel_norms = tf.norm(tf.reshape(grads[-2], (len(features), -1)), axis=1)
    ```
    """

    def _compile(self, jit_compile: bool | None) -> None:
        # One tf.function for every OutputGradients (`functions.traced_graph`): its traces
        # are keyed on the model (weakly), the variables' identities and the shapes,
        # so `output_gradients` called again on the same model traces no more.
        self._traced = traced_graph(_gradients_of_chunk, jit_compile)
        self._sources = [v.value if isinstance(v, keras.Variable) else v for v in self._variables]

    def __call__(self, x: Any) -> Iterator[tuple[np.ndarray, list[tf.Tensor]]]:
        """Streams `(feature_indices, grads)` for the input `x`, one chunk at a time.

        Args:
            x: The model's input: tensor, numpy array or nest of them.

        Returns:
            An iterator of `(feature_indices, grads)`, as `output_gradients` returns.
        """
        return self._stream(as_tensors(x, "x"))

    def _stream(self, x):
        chunk_size = self._chunk_size
        # The number of features is known once the first chunk has run.
        start, num_features = 0, chunk_size
        while start < num_features:
            # Indices past the last feature select nothing: all-zero cotangents.
            feature_indices = np.arange(start, start + chunk_size)
            with explaining_numpy_round_trips(self._model, x):
                grads, num_features = self._traced(
                    self._model,
                    self._sources,
                    x,
                    tf.constant(feature_indices, tf.int32),
                    self._axis,
                )
            num_valid = min(chunk_size, int(num_features) - start)
            if num_valid < chunk_size:
                feature_indices = feature_indices[:num_valid]
                grads = [g[:num_valid] for g in grads]
            yield feature_indices, grads
            start += chunk_size


def _gradients_of_chunk(model, variables, x, feature_indices, axis):
    with tf.GradientTape() as tape:
        # Trainable variables are watched anyway; this covers the others (the
        # tf.Variables the Keras variables wrap, whose reads a tape records).
        tape.watch(variables)
        y = model(x)
    check_single_output(y)
    check_feature_axis(axis, tuple(y.shape))
    axis = axis % y.shape.rank
    # One backward pass at a time rather than vectorized over the chunk: on CPU
    # it took no more time and 20-40% less memory (docs/autodiff.md).
    grads = basis_vjps(tape, y, variables, (axis,), feature_indices, "variables", False)
    return grads, tf.constant(y.shape[axis])

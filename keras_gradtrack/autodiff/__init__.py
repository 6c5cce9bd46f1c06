"""Gradients, VJPs, JVPs and Jacobians of functions: exact, memory-bounded, on every
Keras backend.

`grad`, `vjp` and `jvp` are one reverse- or forward-mode pass. `jacobian`,
`batch_jacobian` and `output_gradients` stack vector-Jacobian products over
one-hot cotangents, `chunk_size` of them per batch, so peak memory grows
with the chunk and not with the number of outputs.

On TensorFlow each function traces into a `tf.function` (without AutoGraph), reused
while `fn` is the same object and the input shapes, dtypes and Python arguments are
unchanged; `OutputGradients` is the compiled form of `output_gradients`, kept across
calls. On JAX and PyTorch they run on the backend's own `vjp`/`jvp`
(`functional.py`), with the same arguments and results: on JAX a Keras model given as
`fn` in one `jax.jit` of its variables' current values, anything else eagerly.
"""

from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

if keras.backend.backend() == "tensorflow":
    from keras_gradtrack.autodiff.functions import batch_jacobian, grad, jacobian, jvp, vjp
    from keras_gradtrack.autodiff.per_feature import OutputGradients
else:
    from keras_gradtrack.autodiff.functional import (  # type: ignore[assignment]
        OutputGradients,
        batch_jacobian,
        grad,
        jacobian,
        jvp,
        vjp,
    )


def output_gradients(
    model: Callable,
    x: Any,
    variables: Any = None,
    axis: int = -1,
    chunk_size: int = 16,
    *,
    jit_compile=None,
) -> Iterator[tuple[np.ndarray, list[Any]]]:
    """Streams the gradient of every output feature with respect to the weights.

    For each feature `f` along `axis` of `y = model(x)`, yields
    `d sum(y[..., f, ...]) / d variables[j]`, the sum running over every other
    axis. One forward pass, then one backward pass per feature, run one after
    another so that peak memory grows with `chunk_size` and not with the number
    of features. On TensorFlow each chunk is one compiled call and all chunks
    share one trace (the last is padded; padding costs no backward pass); on JAX
    a Keras model's pull-backs are compiled, on PyTorch they run eagerly.

    This is `OutputGradients(model, variables, axis, chunk_size)(x)`. On TensorFlow
    a call again on the same model, variables and input shapes reuses the first
    call's trace (held weakly: a model dropped is collected).

    Args:
        model: A Keras model, or a callable taking `x` and returning one tensor.
        x: The model's input: tensor, numpy array or nest of them.
        variables: Variables to differentiate; defaults to
            `model.trainable_variables`.
        axis: The output axis that enumerates the features (`-1`: the last).
            The batch axis (`0`) is refused.
        chunk_size: Features per compiled call.
        jit_compile: On TensorFlow passed to `tf.function` (`True`: XLA); on JAX
            `False` runs eagerly; `True` is refused where nothing compiles.

    Returns:
        An iterator of `(feature_indices, grads)`: `feature_indices` is a numpy
        array of the chunk's features and `grads[j]` has shape
        `(len(feature_indices),) + variables[j].shape`.

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((64, 16)),
        keras.layers.Conv1D(32, 3, padding="same", activation="relu"),
        keras.layers.Dense(144),
    ])
    x = np.random.rand(16, 64, 16).astype("float32")
    for features, grads in keras_gradtrack.autodiff.output_gradients(model, x, chunk_size=8):
        kernel_norms = keras.ops.norm(keras.ops.reshape(grads[-2], (len(features), -1)), axis=1)
    ```
    """
    return OutputGradients(model, variables, axis, chunk_size, jit_compile=jit_compile)(x)


__all__ = [
    "OutputGradients",
    "batch_jacobian",
    "grad",
    "jacobian",
    "jvp",
    "output_gradients",
    "vjp",
]

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

import keras

if keras.backend.backend() == "tensorflow":
    from keras_gradtrack.autodiff.functions import batch_jacobian, grad, jacobian, jvp, vjp
    from keras_gradtrack.autodiff.per_feature import OutputGradients, output_gradients
else:
    from keras_gradtrack.autodiff.functional import (  # type: ignore[assignment]
        OutputGradients,
        batch_jacobian,
        grad,
        jacobian,
        jvp,
        output_gradients,
        vjp,
    )

__all__ = [
    "OutputGradients",
    "batch_jacobian",
    "grad",
    "jacobian",
    "jvp",
    "output_gradients",
    "vjp",
]

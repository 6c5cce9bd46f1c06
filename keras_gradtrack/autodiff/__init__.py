"""Gradients, VJPs, JVPs and Jacobians of functions: compiled, exact, memory-bounded.

`grad`, `vjp` and `jvp` are one reverse- or forward-mode pass. `jacobian`,
`batch_jacobian` and `output_gradients` stack vector-Jacobian products over
one-hot cotangents, `chunk_size` of them per forward pass, so peak memory grows
with the chunk and not with the number of outputs.

Each function traces into a `tf.function` (without AutoGraph), reused while `fn`
is the same object and the input shapes, dtypes and Python arguments are unchanged.
`OutputGradients` is the compiled form of `output_gradients`, kept across calls.
"""

from keras_gradtrack.autodiff.functions import batch_jacobian, grad, jacobian, jvp, vjp
from keras_gradtrack.autodiff.per_feature import OutputGradients, output_gradients

__all__ = [
    "OutputGradients",
    "batch_jacobian",
    "grad",
    "jacobian",
    "jvp",
    "output_gradients",
    "vjp",
]

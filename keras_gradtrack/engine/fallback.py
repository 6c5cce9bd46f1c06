"""Exact, vectorized per-example primitives for a layer without a rule.

The layer is re-run on the inputs it received in the forward pass, and the
per-example gradients of its *own* variables come from one vectorized Jacobian
(`pfor`) of the per-example scalars `<y_i, d_i>`, where `d_i` is the captured
gradient at the layer's output. The cost is that of this one layer, with
memory `B x (its parameters)`; never a whole-model Jacobian.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from keras import tree

from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference
from keras_gradtrack.rules.ops import sum_of_squares


def per_example_output_products(layer: Any, calls: Sequence[LayerCall]) -> tf.Tensor:
    """`sum_c <y_ci, d_ci>` per example, re-running the layer on its recorded inputs.

    Runs after the taps are uninstalled, so `layer.call` is the layer's own.
    """
    total = None
    for call in calls:
        outputs = layer.call(*call.args, **call.kwargs)
        floats = [
            t for t in tree.flatten(outputs) if isinstance(t, tf.Tensor) and t.dtype.is_floating
        ]
        for output, grad in zip(floats, call.output_grads):
            product = tf.cast(output, tf.float32) * tf.cast(grad, tf.float32)
            batch = tf.shape(product)[0]
            per_example = tf.reduce_sum(tf.reshape(product, [batch, -1]), axis=1)
            total = per_example if total is None else total + per_example
    if total is None:
        raise ValueError(f"Layer {layer.name!r} produced no float output to differentiate.")
    return total


def per_example_gradients(
    layer: Any, variables: Sequence[Any], calls: Sequence[LayerCall]
) -> tf.Tensor:
    """`(B, P)`: each example's gradient of the layer's own variables, flattened.

    Args:
        layer: The layer (its taps uninstalled).
        variables: The layer's own trainable variables.
        calls: The layer's calls in this step, with `output_grads` filled in.
    """
    # Keras variables wrap a tf.Variable in `.value`; the tape wants the latter.
    sources = [variable.value for variable in variables]
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(sources)
        per_example = per_example_output_products(layer, calls)
    jacobians = tape.jacobian(
        per_example,
        sources,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
        experimental_use_pfor=True,
    )
    batch = tf.shape(per_example)[0]
    return tf.concat(
        [tf.reshape(tf.cast(jacobian, tf.float32), [batch, -1]) for jacobian in jacobians], axis=1
    )


def fallback_primitives(
    layer: Any,
    variables: Sequence[Any],
    calls: Sequence[LayerCall],
    reference: Reference | None,
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference, from a local Jacobian.

    Args:
        layer: The layer (its taps uninstalled).
        variables: The layer's own trainable variables.
        calls: The layer's calls in this step, with `output_grads` filled in.
        reference: Maps each variable to the reference vector restricted to it;
            None for no dot.

    Returns:
        `LayerPrimitives` with `(B,)` tensors.
    """
    gradients = per_example_gradients(layer, variables, calls)
    sq_norm = sum_of_squares(gradients, axis=1, xla=calls[0].xla)
    if reference is None:
        return LayerPrimitives(sq_norm=sq_norm, dot=None)
    flat_reference = tf.concat([tf.reshape(reference(v), [-1]) for v in variables], axis=0)
    return LayerPrimitives(sq_norm=sq_norm, dot=tf.linalg.matvec(gradients, flat_reference))


def fallback_gram(layer: Any, variables: Sequence[Any], calls: Sequence[LayerCall]) -> tf.Tensor:
    """`(B, B)` Gram matrix `<g_i, g_j>` of the layer's per-example gradients."""
    gradients = per_example_gradients(layer, variables, calls)
    return tf.matmul(gradients, gradients, transpose_b=True)

"""The two ways users get per-example gradient norms and cosines today, as train steps.

Both compute the batch gradient, each example's gradient norm and its cosine with the
batch gradient, and apply Adam: a `tf.map_fn` loop with one `GradientTape` per example,
and `tape.jacobian` of the per-example loss vector. `overhead.py --baselines` times them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

# `tape.jacobian` (pfor) holds B x params numbers and runs B backward passes side by side,
# each over the whole batch's activations; above this estimate it is not run.
JACOBIAN_BUDGET_GIB = 6.0


def jacobian_gib(model: Any, batch_size: int) -> float:
    """Estimated peak of `tape.jacobian`: `4 bytes x 3 live copies x B x (params + B x
    activations per example)`. Measured peaks were 0.3 to 0.9 times this."""
    activations = 0
    for layer in model.layers[1:]:
        for output in tf.nest.flatten(layer.output):
            activations += math.prod(output.shape[1:])
        if isinstance(layer, keras.layers.MultiHeadAttention):  # scores and projections
            length, width = layer.output.shape[1:]
            activations += 2 * layer.num_heads * length * length + 4 * length * width
    return 12 * batch_size * (model.count_params() + batch_size * activations) / 2**30


def per_example_losses(model: Any, loss: Any, x: Any, y: Any) -> Any:
    """`(B,)` losses: the model's loss unreduced, averaged over any other axes."""
    values = loss(y, model(x, training=True))
    if values.shape.rank == 1:
        return values
    return tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)


def unreduced(loss: Any) -> Any:
    return loss.__class__.from_config({**loss.get_config(), "reduction": None})


def flat(gradients: list[Any]) -> Any:
    return tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in gradients], axis=0)


def make_tape_loop_step(model: Any, loss: Any, optimizer: Any) -> Callable[[Any, Any], Any]:
    """A train step plus one `GradientTape` per example (`tf.map_fn`): norms, cosines."""
    variables, loss = model.trainable_variables, unreduced(loss)

    def mean_loss(x: Any, y: Any) -> Any:
        return tf.reduce_mean(per_example_losses(model, loss, x, y))

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            batch_loss = mean_loss(x, y)
        batch_gradient = tape.gradient(batch_loss, variables)
        batch_flat = flat(batch_gradient)

        def norm_and_cosine(example: Any) -> Any:
            x_i, y_i = example
            with tf.GradientTape() as example_tape:
                loss_i = mean_loss(x_i[None], y_i[None])
            gradient_i = flat(example_tape.gradient(loss_i, variables))
            norm_i = tf.norm(gradient_i)
            return norm_i, tf.tensordot(gradient_i, batch_flat, 1) / (norm_i * tf.norm(batch_flat))

        signature = (tf.float32, tf.float32)
        norms, cosines = tf.map_fn(norm_and_cosine, (x, y), fn_output_signature=signature)
        optimizer.apply(batch_gradient, variables)
        return norms, cosines

    return step


def make_jacobian_step(model: Any, loss: Any, optimizer: Any) -> Callable[[Any, Any], Any]:
    """A train step from `tape.jacobian` of the per-example losses: norms, cosines."""
    variables, loss = model.trainable_variables, unreduced(loss)

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            losses = per_example_losses(model, loss, x, y)
        jacobians = [tf.convert_to_tensor(j) for j in tape.jacobian(losses, variables)]
        batch_gradient = [tf.reduce_mean(j, axis=0) for j in jacobians]
        rows = tf.shape(losses)[0]
        sq_norms = tf.add_n([tf.reduce_sum(tf.reshape(j * j, [rows, -1]), 1) for j in jacobians])
        products = zip(jacobians, batch_gradient)
        dots = tf.add_n([tf.reduce_sum(tf.reshape(j * g, [rows, -1]), 1) for j, g in products])
        norms = tf.sqrt(sq_norms)
        optimizer.apply(batch_gradient, variables)
        return norms, dots / (norms * tf.norm(flat(batch_gradient)))

    return step

"""The primitives of one training step, from which every statistic is built."""

from __future__ import annotations

import dataclasses

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class StepPrimitives:
    """Everything a statistic may use, for one step of B examples and L layers.

    All tensors are float32. `g_i` is example i's gradient of its own loss `l_i`
    (regularization excluded), `G` the gradient the optimizer receives
    (unscaled), `S = sum_i g_i`.

    Attributes:
        loss: `(B,)` per-example losses `l_i`, sample weights included.
        sq_norm: `(B, L)` `||g_i^(k)||^2`.
        dot: `(B, L)` `<g_i^(k), G^(k)>`.
        reference_sq_norm: `(L,)` `||G^(k)||^2`.
        sum_sq_norm: `(L,)` `||S^(k)||^2`.
        batch_size: scalar, B as float32.
        gram: `(B, B)` `<g_i, g_j>`, only when a statistic asks for it
            (`Statistic.needs_gram`), else None.
        input_sq_norm: `(B,)` `‖d l_i / d x_i‖^2` over the float inputs, only
            when a statistic asks for it (`Statistic.needs_input_gradients`).
    """

    loss: tf.Tensor
    sq_norm: tf.Tensor
    dot: tf.Tensor
    reference_sq_norm: tf.Tensor
    sum_sq_norm: tf.Tensor
    batch_size: tf.Tensor
    gram: tf.Tensor | None = None
    input_sq_norm: tf.Tensor | None = None

    @property
    def grad_sq_norm(self) -> tf.Tensor:
        """`(B,)` `||g_i||^2` over all layers."""
        return tf.reduce_sum(self.sq_norm, axis=1)

    @property
    def grad_norm(self) -> tf.Tensor:
        """`(B,)` `||g_i||`."""
        return tf.sqrt(self.grad_sq_norm)

    @property
    def reference_norm(self) -> tf.Tensor:
        """Scalar `||G||`."""
        return tf.sqrt(tf.reduce_sum(self.reference_sq_norm))

    @property
    def cosine(self) -> tf.Tensor:
        """`(B,)` `cos(g_i, G)`; NaN where a norm is 0."""
        return tf.reduce_sum(self.dot, axis=1) / (self.grad_norm * self.reference_norm)

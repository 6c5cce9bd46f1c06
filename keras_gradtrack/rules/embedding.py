"""Rule for `keras.layers.Embedding` on integer inputs of any rank.

With `ids_i` the token ids of example i (all axes after the batch folded into
T; the calls of a shared layer stacked along T) and `D_i` (T x dim) the gradient
at the looked-up rows, the gradient of example i is the sparse matrix whose row
v is `sum_{t: id_t = v} d_t`. Repeated ids add before squaring, so the squared
norm groups equal ids; the dot with the reference is a gather,
`<g_i, R> = sum_t <d_t, R[id_t]>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack import rule_math
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Projection, Reference, Rule
from keras_gradtrack.rules.ops import (
    along_time,
    has_plain_weights,
    reshape_per_example,
    sum_of_squares,
)

# Up to this many tokens per example, the masked Gram form (T^2 dim, a dense
# matmul) is as fast as sorting and segment-summing (T dim, but a scatter); beyond
# it the Gram form, quadratic in T, loses quickly (docs/performance.md).
GRAM_MAX_TOKENS = 32


def embedding_applies(layer: Any) -> bool:
    """The rule covers a plain float Embedding (no LoRA, no quantization)."""
    return has_plain_weights(layer)


def token_ids(layer: Any, call: LayerCall) -> tf.Tensor:
    """The row indices the layer looked up in this call, as `Embedding.call` computes them."""
    ids = call.inputs
    if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        raise ValueError(
            f"Embedding layer {layer.name!r} received a {type(ids).__name__}; per-example "
            "gradient statistics support dense integer inputs only (pad the sequences). "
            f"Received: inputs={ids}"
        )
    ids = tf.convert_to_tensor(ids)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    # `ops.take` wraps negative indices around, as numpy does.
    return rule_math.wrapped_ids(ids, layer.input_dim)


def as_token_sequences(layer: Any, calls: Sequence[LayerCall]) -> tuple[tf.Tensor, tf.Tensor]:
    """Stacks every call's ids and output gradients as `(B, T)` int64 and `(B, T, dim)`."""

    def sequences(call: LayerCall) -> tuple[tf.Tensor, tf.Tensor]:
        ids = tf.cast(token_ids(layer, call), tf.int64)
        d = tf.cast(call.output_grad, tf.float32)
        return reshape_per_example(ids, [-1]), reshape_per_example(d, [-1, d.shape[-1]])

    ids, d = along_time(calls, sequences)
    return ids, d


def segment_sq_norm(ids: tf.Tensor, d: tf.Tensor, xla: bool = False) -> tf.Tensor:
    """`sum_v ||sum_{t: id_t = v} d_t||^2` per example, by sorting ids and segment sums.

    Static-shaped (no `tf.unique`), so it also compiles with XLA (`xla`: the step is).
    """
    batch, steps, dim = tf.shape(d)[0], tf.shape(d)[1], tf.shape(d)[2]
    order = tf.argsort(ids, axis=1, stable=True)
    sorted_ids = tf.gather(ids, order, batch_dims=1)
    sorted_d = tf.gather(d, order, batch_dims=1)
    starts_group = tf.not_equal(sorted_ids[:, 1:], sorted_ids[:, :-1])
    starts_group = tf.concat([tf.ones([batch, 1], tf.bool), starts_group], axis=1)
    # Groups of example i are numbered from i * T, so no two examples share one.
    local_group = tf.cumsum(tf.cast(starts_group, tf.int32), axis=1) - 1
    group = local_group + tf.range(batch)[:, None] * steps
    sums = tf.math.unsorted_segment_sum(
        tf.reshape(sorted_d, [-1, dim]), tf.reshape(group, [-1]), batch * steps
    )
    return sum_of_squares(tf.reshape(sums, [batch, -1]), axis=1, xla=xla)


def embedding_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for an Embedding layer.

    Example:

    ```python
    # ids_i = [3, 7, 3], D_i = [d_0, d_1, d_2]  =>  g_i[3] = d_0 + d_2, g_i[7] = d_1,
    # ||g_i||^2 = ||d_0 + d_2||^2 + ||d_1||^2,  <g_i, R> = <d_0 + d_2, R[3]> + <d_1, R[7]>
    ```
    """
    ids, d = as_token_sequences(layer, calls)
    steps = ids.shape[1]
    if steps is not None and steps <= GRAM_MAX_TOKENS:
        sq_norm = rule_math.token_gram_sq_norms(ids, d)
    else:
        sq_norm = segment_sq_norm(ids, d, calls[0].xla)
    if reference is None:
        return LayerPrimitives(sq_norm=sq_norm, dot=None)
    return LayerPrimitives(
        sq_norm=sq_norm, dot=rule_math.token_dots(ids, d, reference(layer.embeddings))
    )


def embedding_cross(
    layer: Any, calls: Sequence[LayerCall], target_calls: Sequence[LayerCall]
) -> tf.Tensor:
    """`(B, T)` products with other examples' gradients: `sum_{t,s: id_t = id'_s} <d_t, d'_s>`.

    Cost `B T_b T S dim` for `T_b` and `S` tokens per example (a masked product of the
    two sides' output gradients), never a `(vocabulary, dim)` gradient.
    """
    ids, d = as_token_sequences(layer, calls)
    target_ids, target_d = as_token_sequences(layer, target_calls)
    same_id = tf.equal(ids[:, :, None, None], target_ids[None, None, :, :])
    products = tf.einsum("btd,jsd->btjs", d, target_d)
    return tf.reduce_sum(tf.where(same_id, products, 0.0), axis=[1, 3])


def embedding_sketch(
    layer: Any, calls: Sequence[LayerCall], projection: Projection
) -> list[tuple[Any, tf.Tensor]]:
    """The sketch `sum_t R[id_t]^T (C^T d_t)` (rows of R looked up, no one-hot rows)."""
    ids, d = as_token_sequences(layer, calls)
    rows = tf.gather(projection.rows(layer.embeddings), ids)
    projected_d = tf.einsum("btd,ds->bts", d, projection.columns(layer.embeddings))
    return [(layer.embeddings, tf.einsum("btr,bts->brs", rows, projected_d))]


EMBEDDING = Rule(
    "embedding",
    embedding_primitives,
    embedding_applies,
    split_activation=False,
    cross=embedding_cross,
    sketch=embedding_sketch,
)

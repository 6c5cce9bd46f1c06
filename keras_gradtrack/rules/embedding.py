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

from keras_gradtrack import attribution_math, rule_math
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Projection, Reference, Rule
from keras_gradtrack.rules.ops import as_token_sequences, has_plain_weights, token_sq_norms


def embedding_applies(layer: Any) -> bool:
    """The rule covers a plain float Embedding (no LoRA, no quantization)."""
    return has_plain_weights(layer)


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
    sq_norm = token_sq_norms(ids, d, calls[0].xla)
    if reference is None:
        return LayerPrimitives(sq_norm=sq_norm, dot=None)
    return LayerPrimitives(
        sq_norm=sq_norm, dot=rule_math.token_dots(ids, d, reference(layer.embeddings))
    )


def embedding_cross(
    layer: Any, calls: Sequence[LayerCall], target_calls: Sequence[LayerCall]
) -> Any:
    """`(B, T)` products with other examples' gradients: `sum_{t,s: id_t = id'_s} <d_t, d'_s>`.

    Cost `B T_b T S dim` for `T_b` and `S` tokens per example (a masked product of the
    two sides' output gradients), never a `(vocabulary, dim)` gradient.
    """
    ids, d = as_token_sequences(layer, calls)
    target_ids, target_d = as_token_sequences(layer, target_calls)
    return attribution_math.token_cross(ids, d, target_ids, target_d)


def embedding_sketch(
    layer: Any, calls: Sequence[LayerCall], projection: Projection
) -> list[tuple[Any, Any]]:
    """The sketch `sum_t R[id_t]^T (C^T d_t)` (rows of R looked up, no one-hot rows)."""
    ids, d = as_token_sequences(layer, calls)
    rows, columns = projection.rows(layer.embeddings), projection.columns(layer.embeddings)
    return [(layer.embeddings, attribution_math.token_sketches(ids, d, rows, columns))]


EMBEDDING = Rule(
    "embedding",
    embedding_primitives,
    embedding_applies,
    split_activation=False,
    cross=embedding_cross,
    sketch=embedding_sketch,
)

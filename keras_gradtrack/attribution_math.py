"""The attribution math both engines share, in `keras.ops` only: products of per-example
gradients with targets' gradients, and gradient sketches, from the layers' factors
where a rule can (Dense, Embedding) or from per-example gradients.

A variable's gradient, as a `(rows, cols)` matrix `M` (cols its last axis), is
sketched as `R^T M C` (`engine.attribution_requests.projection_matrices`). Like
`rule_math`, nothing here imports TensorFlow or JAX; results are float32.

Example:

```python
products = rule_math.dense_cross(a, d, a_targets, d_targets, True, True)   # Dense
sketch = factor_sketches(a, d, rows, columns)    # (B, r_in, r_out), no (B, in, out)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops


def paired_products(per_example: Sequence[Any], targets: Sequence[Any]) -> Any:
    """`(B, T)` `<g_i, h_j>` summed over paired per-example gradients `(B, n)` and `(T, n)`.

    Example:

    ```python
    paired_products([kernel_grads, bias_grads], [target_kernel_grads, target_bias_grads])
    ```
    """
    products = [ops.matmul(g, ops.transpose(h)) for g, h in zip(per_example, targets)]
    total = products[0]
    for product in products[1:]:
        total = total + product
    return total


def token_cross(ids: Any, d: Any, ids2: Any, d2: Any) -> Any:
    """`(B, T)` products of two sets of Embedding gradients: `sum_{t,s: id_t = id'_s}
    <d_t, d'_s>`, for ids `(B, S)`, `(T, S')` and output gradients `(B, S, dim)`,
    `(T, S', dim)` (ids wrapped, same dtype); never a `(vocabulary, dim)` gradient.

    Example:

    ```python
    token_cross(ids, d, ids, d)    # the (B, B) Gram matrix
    ```
    """
    same_id = ops.equal(ids[:, :, None, None], ids2[None, None, :, :])
    products = ops.einsum("btd,jsd->btjs", d, d2)
    return ops.sum(ops.where(same_id, products, ops.zeros_like(products)), axis=(1, 3))


def projected_gradients(matrices: Any, rows: Any, columns: Any) -> Any:
    """`(B, r_in, r_out)` sketches `R^T M_i C` of per-example gradients as matrices
    `(B, rows, cols)`, for `R` (rows, r_in) and `C` (cols, r_out).

    Example:

    ```python
    projected_gradients(ops.reshape(kernel_grads, (batch, -1, units)), rows, columns)
    ```
    """
    projected = ops.einsum("brc,cs->brs", matrices, columns)
    return ops.einsum("brs,rq->bqs", projected, rows)


def factor_sketches(a: Any, d: Any, rows: Any, columns: Any) -> Any:
    """`(B, r_in, r_out)` sketches of a Dense kernel's per-example gradients `A_i^T D_i`
    from its factors: `sum_t (R^T a_it)(C^T d_it)^T`, for `a` (B, T, in), `d` (B, T,
    out); never `A_i^T D_i` itself.

    Example:

    ```python
    factor_sketches(a[:, None], d[:, None], rows, columns)    # 2-D inputs
    ```
    """
    projected_a = ops.einsum("bti,ir->btr", a, rows)
    projected_d = ops.einsum("bto,os->bts", d, columns)
    return ops.einsum("btr,bts->brs", projected_a, projected_d)


def bias_sketches(d: Any, rows: Any, columns: Any) -> Any:
    """`(B, 1, r_out)` sketches of a Dense bias's per-example gradients `sum_t d_it`
    (`d` (B, T, out)): `C^T sum_t d_it`, times `R`, the one-by-one row side.

    Example:

    ```python
    bias_sketches(d[:, None], rows, columns)
    ```
    """
    projected_d = ops.einsum("bto,os->bs", d, columns)
    return projected_d[:, None, :] * rows[0, 0]


def token_sketches(ids: Any, d: Any, rows: Any, columns: Any) -> Any:
    """`(B, r_in, r_out)` sketches of an Embedding's per-example gradients, rows `d_t`
    added at `ids_t`: `sum_t R[id_t]^T (C^T d_t)` (rows of R looked up, no one-hot rows),
    for ids `(B, T)` (wrapped) and output gradients `(B, T, dim)`.

    Example:

    ```python
    token_sketches(ids, d, rows, columns)
    ```
    """
    looked_up = ops.take(rows, ids, axis=0)
    projected_d = ops.einsum("btd,ds->bts", d, columns)
    return ops.einsum("btr,bts->brs", looked_up, projected_d)

"""Per-layer rules over `keras.ops`: per-example primitives from one backward pass, on any backend.

A rule receives, per call of its layer in the step, a `ProbedCall`: the layer's
inputs and `output_grad`, example i's gradient of its own loss `l_i` at the
layer's (pre-activation) output. From them it computes, without a per-example
pass over the model, either the layer's per-example gradients (`per_example`,
laid out `(B, *variable.shape)`, float32) or directly the primitives
(`primitives`: `||g_i||^2`, `<g_i, R>` and `||sum_i g_i||^2`) without building
them. Written once in `keras.ops` (the math in `rule_math`), they run on the
JAX and PyTorch engines alike; a layer without a rule runs on its backend's exact
per-layer fallback (`fallback` of `summed_per_example`).

Example:

```python
DENSE.primitives(layer, call, refs)   # norms from ||a_i||^2 ||d_i||^2, no per-example pass
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from keras_gradtrack import rule_math
from keras_gradtrack.rule_math import f32

BACKEND_NAMES = {"jax": "JAX", "torch": "PyTorch", "tensorflow": "TensorFlow"}


def backend_name() -> str:
    """The name of Keras' backend as messages say it ("JAX", "PyTorch")."""
    backend = keras.backend.backend()
    return BACKEND_NAMES.get(backend, backend)


@dataclasses.dataclass(frozen=True)
class ProbedCall:
    """One call of a tracked layer in the step, as the rules see it.

    Attributes:
        inputs: The layer's first argument, `(B, ...)`.
        kwargs: The call's other keyword arguments (`training`, ...).
        output_grad: `(B, ...)` float32, `d l_i / d z_i` at the layer's
            pre-activation output (its output when it has no `activation`).
        reference_factor: `c` where the layer's batch gradient is exactly
            `c sum_i g_i` (its only call, no added losses), else None.
    """

    inputs: Any
    kwargs: dict[str, Any]
    output_grad: Any
    reference_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class LayerPrimitives:
    """A layer's primitives for the step: `(B,)` `sq_norm`, `(B,)` `dot`, scalar `sum_sq_norm`
    (a rule's direct form leaves it None where its call has a `reference_factor`: the
    step then takes it from the batch gradient, and an eager backend does not compute
    what would go unused). `per_example`: where they came from the layer's per-example
    gradients (its rule's or the fallback's, not a direct form), those, one `(B,
    *variable.shape)` per trainable variable (a private step's clipped sum reuses them).
    `materialized`: a rule built them itself for the primitives and kept them (an eager
    backend's Dense on sequences): its form is `materialized` all the same."""

    sq_norm: Any
    dot: Any
    sum_sq_norm: Any
    per_example: Sequence[Any] | None = None
    materialized: bool = False


# (layer, its trainable variables' values, call, its non-trainable variables' values)
# -> one `(B, *variable.shape)` gradient per trainable variable.
PerExample = Callable[[Any, Sequence[Any], ProbedCall, Sequence[Any]], list[Any]]
# (layer, call, the batch gradient per variable) -> the primitives, or None (not applicable).
Primitives = Callable[[Any, ProbedCall, Sequence[Any]], "LayerPrimitives | None"]
# (layer, call) -> the `(B, B)` Gram matrix `<g_i, g_j>` of its per-example gradients, or
# None (not applicable).
Gram = Callable[[Any, ProbedCall], Any]


@dataclasses.dataclass(frozen=True)
class ProbedRule:
    """How one layer family's per-example primitives are computed from a probed pass.

    Attributes:
        name: Shown in the path of the layer (`rule:<name>`).
        per_example: The layer's per-example gradients (None: the fallback's).
        primitives: The primitives without per-example gradients, for a layer
            called once in the step (None, or returning None: from `per_example`).
        applies: Whether the rule covers a given layer of its class (None: every
            one); a layer it does not cover runs on the fallback, and its path says so.
        gram: The Gram matrix of the per-example gradients in a factored form, for a
            layer called once in the step (None, or returning None: from `per_example`;
            `pairwise_cosine` asks for it).
        sums_batch_gradient: Whether the batch gradient of the layer's kernels (not
            its biases) is taken as the sum of their per-example gradients where the
            step materializes them and the loss is `c sum_i l_i` alone: the backward
            pass's own kernel gradient then goes unused and the compiler drops it.
            Set where that is measured faster on JAX: the convolutions (XLA's batched
            filter gradient costs on a CPU what the per-example windows' products
            cost), and Dense and EinsumDense on sequences (a product over `B T`
            positions, where the sum of the materialized gradients reads `B` values
            per weight).
    """

    name: str
    per_example: PerExample | None = None
    primitives: Primitives | None = None
    applies: Callable[[Any], bool] | None = None
    gram: Gram | None = None
    sums_batch_gradient: bool = False


def splits_activation(layer: Any) -> bool:
    """Whether the layer's probe goes before its `activation` (at `z` of `activation(z)`).
    Not a recurrent layer's: its `activation` is its cell's, applied inside the loop."""
    if isinstance(layer, keras.layers.RNN):
        return False
    return getattr(layer, "activation", None) is not None and callable(layer.activation)


def summed_per_example(
    layer: Any,
    rule: ProbedRule | None,
    values: Sequence[Any],
    calls: Sequence[ProbedCall],
    others: Sequence[Any],
    fallback: PerExample,
) -> list[Any]:
    """The layer's per-example gradients in the step, one `(B, *variable.shape)` per
    trainable variable: its rule's (or the backend's `fallback`) per call, summed over
    its calls."""
    summed: list[Any] | None = None
    for call in calls:
        if rule is not None and rule.per_example is not None:
            grads = rule.per_example(layer, values, call, others)
        else:
            grads = fallback(layer, values, call, others)
        summed = grads if summed is None else [s + g for s, g in zip(summed, grads)]
    assert summed is not None, "a tracked layer is called at least once"
    return summed


def scattered_rows(ids: Any, rows: Any, tables: int, size: int) -> Any:
    """`(tables, size, dim)`: row `rows[b, t]` added at `[b, ids[b, t]]` (ids `(B, T)`
    int32 in `[0, size)`, rows `(B, T, dim)`; `tables` 1 with B folded into T)."""
    batch, _, dim = rows.shape
    offsets = ops.arange(batch, dtype="int32")[:, None] * (size if tables > 1 else 0)
    segments = ops.reshape(ids + offsets, (-1,))
    summed = ops.segment_sum(ops.reshape(rows, (-1, dim)), segments, num_segments=tables * size)
    return ops.reshape(summed, (tables, size, dim))


# -- Dense ------------------------------------------------------------------


def plain_weights(layer: Any) -> bool:
    """A layer without LoRA and not quantized: its variables are its kernel and bias."""
    return (
        not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
    )


def _split_kernel_bias(layer: Any, refs: Sequence[Any] | None) -> tuple[Any, Any]:
    """`(kernel, bias)` of `refs` (the bias None without one); of the layer's variables
    where `refs` is None (norm-only: their shapes)."""
    found = layer.trainable_variables if refs is None else refs
    by_name = {v.name: ref for v, ref in zip(layer.trainable_variables, found)}
    return by_name["kernel"], by_name.get("bias")


# Per-example gradients of a sequence Dense layer are materialized (one einsum of the
# forward's cost, which also gives <g_i, R> for free) up to this many float32 values;
# beyond, the Gram form `<A_i A_i^T, D_i D_i^T>` avoids holding them where it holds
# fewer itself (`dense_takes_gram_form`).
MATERIALIZED_VALUES = 1 << 26


def dense_takes_gram_form(batch: int, steps: int, width_in: int, width_out: int) -> bool:
    """Whether a Dense layer on `(batch, steps, width_in)` inputs takes the Gram form:
    only where its per-example gradients (`batch * width_in * width_out` values) exceed
    `MATERIALIZED_VALUES` and the Gram form's two `(batch, steps, steps)` matrices are
    smaller still. At long sequences the Gram matrices, quadratic in `steps`, outgrow
    the materialized gradients, which do not grow with `steps` at all.

    Example:

    ```python
    dense_takes_gram_form(64, 128, 768, 3072)    # True: 2 * 128^2 < 768 * 3072
    dense_takes_gram_form(64, 4096, 768, 3072)   # False: 2 * 4096^2 > 768 * 3072
    ```
    """
    materialized = batch * width_in * width_out
    return materialized > MATERIALIZED_VALUES and 2 * steps**2 < width_in * width_out


def dense_primitives(
    layer: Any, call: ProbedCall, refs: Sequence[Any] | None, materialize: bool = False
) -> LayerPrimitives | None:
    """Dense: `||g_i||^2 = ||a_i||^2 ||d_i||^2` and `<g_i, R> = a_i^T R d_i` on 2-D
    inputs; on sequences the Gram form where the per-example gradients would hold too
    many values and the Gram form fewer (`dense_takes_gram_form`), else `g_i = A_i^T
    D_i` materialized: here with `materialize` (an eager backend, whose backward pass
    computes the kernel's batch gradient whatever the step does), else by the step
    (None returned: `dense_per_example`), whose sum then replaces the backward pass's
    kernel gradient (`sums_batch_gradient`, JAX).
    With `refs=None` (norm-only) it returns `dot=None` and forms no product with a
    reference."""
    if not plain_weights(layer):
        return None
    if refs is not None and len(layer.trainable_variables) != len(refs):
        return None
    kernel_ref, bias_ref = _split_kernel_bias(layer, refs)
    a, d = f32(call.inputs), f32(call.output_grad)
    batch = a.shape[0]
    a = ops.reshape(a, (batch, -1, a.shape[-1]))
    d = ops.reshape(d, (batch, -1, d.shape[-1]))
    steps, d_in, d_out = a.shape[1], a.shape[2], d.shape[2]
    materialized = False
    if steps == 1:
        rows, grads = a[:, 0], d[:, 0]
        sq_norm = ops.sum(rows**2, axis=1) * ops.sum(grads**2, axis=1)
        if refs is None:
            dot = None
        elif call.reference_factor is not None and rule_math.gram_has_fewer_products(
            batch, d_in, d_out
        ):
            # R = c sum_j a_j d_j^T: <g_i, R> = c sum_j <a_i, a_j> <d_i, d_j>, cheaper
            # than a_i^T R d_i when the batch is smaller than the layer.
            gram = ops.matmul(rows, ops.transpose(rows)) * ops.matmul(grads, ops.transpose(grads))
            dot = call.reference_factor * ops.sum(gram, axis=1)
        else:
            dot = ops.sum(ops.matmul(rows, f32(kernel_ref)) * grads, axis=1)
    elif dense_takes_gram_form(batch, steps, d_in, d_out):
        sq_norm = rule_math.gram_sq_norms(a, d)
        dot = None
        if refs is not None:
            dot = ops.sum(ops.einsum("bti,io->bto", a, f32(kernel_ref)) * d, axis=(1, 2))
    elif not materialize:
        return None
    else:
        materialized = True
        per_example = rule_math.dense_kernel_gradients(a, d)
        sq_norm = ops.sum(per_example**2, axis=(1, 2))
        dot = None if refs is None else ops.einsum("bio,io->b", per_example, f32(kernel_ref))
    sum_sq_norm = None  # with a reference factor, the step's ||G||^2 / c^2
    if call.reference_factor is None:
        sum_sq_norm = ops.sum(ops.einsum("bti,bto->io", a, d) ** 2)
    if bias_ref is not None:
        bias_grad = rule_math.bias_gradients(d, bias_ref.shape)
        sq_norm = sq_norm + ops.sum(bias_grad**2, axis=1)
        if dot is not None:
            dot = dot + ops.matmul(bias_grad, f32(bias_ref))
        if sum_sq_norm is not None:
            sum_sq_norm = sum_sq_norm + ops.sum(ops.sum(bias_grad, axis=0) ** 2)
    return LayerPrimitives(sq_norm, dot, sum_sq_norm, materialized=materialized)


def dense_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    a, d = f32(call.inputs), f32(call.output_grad)
    batch = a.shape[0]
    a = ops.reshape(a, (batch, -1, a.shape[-1]))
    d = ops.reshape(d, (batch, -1, d.shape[-1]))
    grads = {
        "kernel": rule_math.dense_kernel_gradients(a, d),
        "bias": rule_math.bias_gradients(d, (d.shape[-1],)),
    }
    return [grads[v.name] for v in layer.trainable_variables]


def dense_gram(layer: Any, call: ProbedCall) -> Any:
    """Dense on 2-D inputs: `<g_i, g_j> = (a_i . a_j (+ 1 with a bias)) (d_i . d_j)`
    (`rule_math.dense_cross`); None on sequences (from the per-example gradients)."""
    if not plain_weights(layer):
        return None
    a, d = f32(call.inputs), f32(call.output_grad)
    batch = a.shape[0]
    a = ops.reshape(a, (batch, -1, a.shape[-1]))
    d = ops.reshape(d, (batch, -1, d.shape[-1]))
    if a.shape[1] != 1:
        return None
    names = {v.name for v in layer.trainable_variables}
    rows, grads = a[:, 0], d[:, 0]
    return rule_math.dense_cross(rows, grads, rows, grads, "kernel" in names, "bias" in names)


# A layer with LoRA runs on `LORA_DENSE` (below), a quantized one on the fallback, and
# its path says so.
DENSE = ProbedRule(
    "dense",
    dense_per_example,
    dense_primitives,
    applies=plain_weights,
    gram=dense_gram,
    sums_batch_gradient=True,
)


# -- EinsumDense ------------------------------------------------------------


def einsum_dense_applies(layer: Any) -> bool:
    """The rule covers a plain float EinsumDense whose equation keeps the batch axis first
    (`rule_math.einsum_roles`, the TensorFlow engine's reading of the equation)."""
    input_rank = layer.input_spec.ndim if layer.input_spec is not None else None
    return plain_weights(layer) and rule_math.einsum_roles(layer.equation, input_rank) is not None


def einsum_dense_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """EinsumDense `x,k->y`: example i's kernel gradient is `einsum(x_i, d_i)` over the
    axes the kernel does not have (`rule_math.einsum_kernel_gradients`); the bias's is
    `d_i` summed where it is broadcast (`rule_math.bias_gradients`)."""
    roles = rule_math.einsum_roles(layer.equation, len(call.inputs.shape))
    if roles is None:
        raise ValueError(
            f"EinsumDense layer {layer.name!r}: the equation has no batch letter first in "
            f"its input and output. Received: equation={layer.equation!r}, input "
            f"shape={call.inputs.shape}"
        )
    grads = {"kernel": rule_math.einsum_kernel_gradients(roles, call.inputs, call.output_grad)}
    for variable in layer.trainable_variables:
        if variable.name == "bias":
            bias_grad = rule_math.bias_gradients(call.output_grad, variable.shape)
            grads["bias"] = ops.reshape(bias_grad, (bias_grad.shape[0], *variable.shape))
    return [grads[v.name] for v in layer.trainable_variables]


EINSUM_DENSE = ProbedRule(
    "einsum_dense", einsum_dense_per_example, applies=einsum_dense_applies, sums_batch_gradient=True
)


# -- Embedding --------------------------------------------------------------


def embedding_primitives(
    layer: Any, call: ProbedCall, refs: Sequence[Any] | None
) -> LayerPrimitives | None:
    """Embedding: example i's gradient adds `d_it` to row `id_it`; `||g_i||^2` sums
    `<d_it, d_is>` over the positions with equal ids (the masked Gram form up to
    `rule_math.GRAM_MAX_TOKENS` tokens, sorting and segment sums beyond), `<g_i, R> =
    sum_t <d_it, R[id_it]>` (`dot=None` with `refs=None`: norm-only)."""
    if not plain_weights(layer) or (refs is not None and len(refs) != 1):
        return None
    (table_ref,) = layer.trainable_variables if refs is None else refs
    ids, d = call.inputs, f32(call.output_grad)
    batch, dim = ids.shape[0], d.shape[-1]
    ids = ops.reshape(ops.cast(ids, "int32"), (batch, -1))
    d = ops.reshape(d, (batch, -1, dim))
    ids = rule_math.wrapped_ids(ids, table_ref.shape[0])
    if ids.shape[1] <= rule_math.GRAM_MAX_TOKENS:
        sq_norm = rule_math.token_gram_sq_norms(ids, d)
    else:  # the Gram form's (B, T, T) matrices would outgrow the output gradient
        sq_norm = rule_math.token_segment_sq_norms(ids, d)
    dot = None if refs is None else rule_math.token_dots(ids, d, table_ref)
    sum_sq_norm = None  # with a reference factor, the step's ||G||^2 / c^2
    if call.reference_factor is None:
        summed = scattered_rows(
            ops.reshape(ids, (1, -1)), ops.reshape(d, (1, -1, dim)), 1, table_ref.shape[0]
        )
        sum_sq_norm = ops.sum(summed**2)
    return LayerPrimitives(sq_norm, dot, sum_sq_norm)


def embedding_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    ids, d = call.inputs, f32(call.output_grad)
    batch, dim = ids.shape[0], d.shape[-1]
    ids = ops.reshape(ops.cast(ids, "int32"), (batch, -1))
    ids = rule_math.wrapped_ids(ids, values[0].shape[0])
    return [scattered_rows(ids, ops.reshape(d, (batch, -1, dim)), batch, values[0].shape[0])]


EMBEDDING = ProbedRule(
    "embedding", embedding_per_example, embedding_primitives, applies=plain_weights
)


def prelu_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """PReLU's `alpha`: `rule_math.prelu_gradients`."""
    return [rule_math.prelu_gradients(call.inputs, call.output_grad, layer.shared_axes)]


def layer_scale_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """ConvNeXt's LayerScale `gamma`: `rule_math.layer_scale_gradients`."""
    return [rule_math.layer_scale_gradients(call.inputs, call.output_grad)]


PRELU = ProbedRule("prelu", prelu_per_example)
LAYER_SCALE = ProbedRule("layer_scale", layer_scale_per_example)


# -- LoRA -------------------------------------------------------------------


def lora_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """A Dense, EinsumDense or Embedding with LoRA (kernel `W + s a b`, `W` frozen): each
    factor's gradient is an EinsumDense stage's (`rule_math.lora_einsum_stages`), an
    Embedding's `g_i(a)` the rows `s d_t b^T` added at the ids; the bias as without LoRA."""
    value_of = {v.name: value for v, value in zip(layer.non_trainable_variables, others)}
    value_of.update({v.name: value for v, value in zip(layer.trainable_variables, values)})
    scale = rule_math.lora_scale(layer)
    grads = {}
    if hasattr(layer, "lora_embeddings_a"):
        lora_a, lora_b = value_of["lora_embeddings_a"], value_of["lora_embeddings_b"]
        batch = call.inputs.shape[0]
        ids = ops.reshape(ops.cast(call.inputs, "int32"), (batch, -1))
        ids = rule_math.wrapped_ids(ids, lora_a.shape[0])
        d = ops.reshape(f32(call.output_grad), (batch, ids.shape[1], -1))
        projected_grad, looked_up = rule_math.lora_embedding_operands(ids, d, lora_a, lora_b, scale)
        grads["lora_embeddings_a"] = scattered_rows(ids, projected_grad, batch, lora_a.shape[0])
        grads["lora_embeddings_b"] = rule_math.dense_kernel_gradients(looked_up, d)
    else:
        lora_a, lora_b = value_of["lora_kernel_a"], value_of["lora_kernel_b"]
        if hasattr(layer, "equation"):
            roles = rule_math.einsum_roles(layer.equation, len(call.inputs.shape))
            assert roles is not None  # `lora_covered` read the equation
            stages = rule_math.lora_einsum_stages(
                roles, call.inputs, call.output_grad, lora_a, lora_b, scale
            )
        else:
            stages = rule_math.lora_dense_stages(
                call.inputs, call.output_grad, lora_a, lora_b, scale
            )
        for stage in stages:
            grads[f"lora_kernel_{stage.factor}"] = rule_math.einsum_kernel_gradients(
                stage.roles, stage.inputs, stage.output_grad
            )
    for variable in layer.trainable_variables:
        if variable.name == "bias":
            bias_grad = rule_math.bias_gradients(call.output_grad, variable.shape)
            grads["bias"] = ops.reshape(bias_grad, (bias_grad.shape[0], *variable.shape))
    return [grads[v.name] for v in layer.trainable_variables]


# Quantized layers, and layers whose kernel was made trainable again, stay on the
# fallback (`rule_math.lora_covered`), and their path says so.
LORA_DENSE = ProbedRule("lora_dense", lora_per_example, applies=rule_math.lora_covered)
LORA_EINSUM_DENSE = ProbedRule(
    "lora_einsum_dense", lora_per_example, applies=rule_math.lora_covered
)
LORA_EMBEDDING = ProbedRule("lora_embedding", lora_per_example, applies=rule_math.lora_covered)

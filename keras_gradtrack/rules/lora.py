"""Rules for `Dense`, `EinsumDense` and `Embedding` layers with LoRA (`enable_lora`).

LoRA freezes the kernel `W` and trains two factors: the layer computes with
`W + s a b`, `s = lora_alpha / rank`. Each factor's per-example gradient is that of
one of two EinsumDense stages in a row (`rule_math.lora_einsum_stages`): for Dense on
`A_i` (T x in) with output gradient `D_i`, `g_i(a) = A_i^T (s D_i b^T)` (in x r) and
`g_i(b) = (s A_i a)^T D_i` (r x out), products of the layer's input and output
gradient with one factor, never the full kernel. An Embedding's `g_i(a)` adds the rows
`s d_t b^T` at the ids (the Embedding rule's norms and dots), its `g_i(b) =
(s a[ids_i])^T D_i`. A trainable bias is as without LoRA. Quantized layers, and
layers whose kernel was made trainable again, stay on the exact fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack import rule_math
from keras_gradtrack.rule_math import LoraStage
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference, Rule
from keras_gradtrack.rules.ops import (
    as_token_sequences,
    canonical_operands,
    canonical_primitives,
    materialized,
    positions_per_example,
    references_of,
    roles_of_call,
    sequence_kernel_sq_norm,
    summed,
    summed_bias_gradient,
    token_sq_norms,
    zero_primitives,
)


def factors(layer: Any) -> tuple[Any, Any]:
    """The layer's LoRA factors `(a, b)`."""
    if hasattr(layer, "lora_embeddings_a"):
        return layer.lora_embeddings_a, layer.lora_embeddings_b
    return layer.lora_kernel_a, layer.lora_kernel_b


def trained_bias(layer: Any) -> Any | None:
    bias = getattr(layer, "bias", None)
    return bias if bias is not None and bias.trainable else None


def stages_of_call(layer: Any, call: LayerCall) -> tuple[LoraStage, LoraStage]:
    """The two stages of one call of a Dense or EinsumDense layer with LoRA."""
    a, b = factors(layer)
    scale = rule_math.lora_scale(layer)
    if hasattr(layer, "equation"):
        roles = roles_of_call(layer, ops.convert_to_tensor(call.inputs))
        return rule_math.lora_einsum_stages(roles, call.inputs, call.output_grad, a, b, scale)
    return rule_math.lora_dense_stages(call.inputs, call.output_grad, a, b, scale)


def stages_by_factor(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, list[LoraStage]]]:
    """`[(factor variable, its stage in every call)]` for the trained factors."""
    a, b = factors(layer)
    stages = [stages_of_call(layer, call) for call in calls]
    return [
        (variable, [stage for pair in stages for stage in pair if stage.factor == name])
        for variable, name in ((a, "a"), (b, "b"))
        if variable.trainable
    ]


def stage_primitives(
    variable: Any, stages: Sequence[LoraStage], reference: Reference | None, xla: bool
) -> LayerPrimitives:
    """One factor's primitives from its stages (one per call, stacked along the steps),
    as EinsumDense's rule computes a kernel's (`einsum.canonical_primitives`)."""
    x, d = canonical_operands([(s.roles, s.inputs, s.output_grad) for s in stages], variable.shape)
    factor_ref = None if reference is None else reference(variable)
    return canonical_primitives(stages[0].roles, x, d, factor_ref, xla)


def lora_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference of a layer with LoRA, from
    the factors' stages (Dense, EinsumDense) or the Embedding's operands.

    Example:

    ```python
    # Dense, 2-D: ||g_i(a)||^2 = ||a_i||^2 ||s b d_i||^2, ||g_i(b)||^2 = ||s a^T a_i||^2 ||d_i||^2
    ```
    """
    xla = calls[0].xla
    if hasattr(layer, "lora_embeddings_a"):
        terms = embedding_terms(layer, calls, reference)
    else:
        terms = [
            stage_primitives(variable, stages, reference, xla)
            for variable, stages in stages_by_factor(layer, calls)
        ]
    bias = trained_bias(layer)
    if bias is not None:
        bias_grad = summed_bias_gradient(calls, bias.shape)
        terms.append(materialized([bias_grad], references_of(reference, [bias]), xla))
    if not terms:
        return zero_primitives(ops.convert_to_tensor(calls[0].output_grad), reference)
    return summed(terms)


def embedding_terms(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> list[LayerPrimitives]:
    """An Embedding's factors: `a` as an Embedding of `s D b^T`, `b` as a Dense on
    `s a[ids]` (see `rule_math.lora_embedding_operands`)."""
    a, b = factors(layer)
    ids, d = as_token_sequences(layer, calls)
    projected_grad, looked_up = rule_math.lora_embedding_operands(
        ids, d, a, b, rule_math.lora_scale(layer)
    )
    xla = calls[0].xla
    terms = []
    if a.trainable:
        sq_norm = token_sq_norms(ids, projected_grad, xla)
        dot = None
        if reference is not None:
            dot = rule_math.token_dots(ids, projected_grad, reference(a))
        terms.append(LayerPrimitives(sq_norm, dot))
    if b.trainable:
        dot = None
        if reference is not None:
            projected = ops.einsum("btr,ro->bto", looked_up, reference(b))
            dot = ops.sum(projected * d, axis=(1, 2))
        terms.append(LayerPrimitives(sequence_kernel_sq_norm(looked_up, d, xla), dot))
    return terms


def lora_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of the trained factors (and bias), each in its variable's
    layout; an Embedding's `g_i(a)` is a `(vocabulary, rank)` table per example."""
    if hasattr(layer, "lora_embeddings_a"):
        pairs = embedding_per_example(layer, calls)
    else:
        pairs = [
            (
                variable,
                rule_math.total(
                    [
                        rule_math.einsum_kernel_gradients(s.roles, s.inputs, s.output_grad)
                        for s in stages
                    ]
                ),
            )
            for variable, stages in stages_by_factor(layer, calls)
        ]
    bias = trained_bias(layer)
    if bias is not None:
        pairs.append((bias, summed_bias_gradient(calls, bias.shape)))
    return pairs


def embedding_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    a, b = factors(layer)
    ids, d = as_token_sequences(layer, calls)
    projected_grad, looked_up = rule_math.lora_embedding_operands(
        ids, d, a, b, rule_math.lora_scale(layer)
    )
    pairs = []
    if a.trainable:
        batch, rows = ops.shape(ids)[0], a.shape[0]
        # Example i's rows are segments i * rows + id: a table per example.
        segments = ids + ops.cast(ops.arange(batch), ids.dtype)[:, None] * rows
        tables = ops.segment_sum(
            ops.reshape(projected_grad, (-1, a.shape[1])),
            ops.reshape(segments, (-1,)),
            num_segments=batch * rows,
        )
        pairs.append((a, ops.reshape(tables, (-1, *a.shape))))
    if b.trainable:
        pairs.append((b, rule_math.dense_kernel_gradients(looked_up, d)))
    return pairs


def lora_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """Dense and EinsumDense on sequences: the factors' gradients are small (the rank
    replaces one side of the kernel), so materializing them, `T r (in + out)` products
    per example, costs less than the Gram form wherever `T` exceeds about `r`
    (`rule_math.gram_is_cheaper` decides for Dense); never on 2-D inputs (the direct
    form is free) or for an Embedding (its table gradient is sparse)."""
    if hasattr(layer, "lora_embeddings_a"):
        return False
    steps = positions_per_example([call.inputs for call in calls])
    if steps == 1:
        return False
    if hasattr(layer, "equation"):
        return True
    a, b = factors(layer)
    (d_in, rank), d_out = a.shape, b.shape[1]
    return not (
        rule_math.gram_is_cheaper(steps, d_in, rank, dots=True)
        or rule_math.gram_is_cheaper(steps, rank, d_out, dots=True)
    )


def lora_rule(name: str) -> Rule:
    """The LoRA rule of one layer family (`split_activation` as the family's own rule)."""
    return Rule(
        name,
        lora_primitives,
        rule_math.lora_covered,
        split_activation=False if name == "lora_embedding" else None,
        per_example=lora_per_example,
        materializes=lora_materializes,
    )


LORA_DENSE = lora_rule("lora_dense")
LORA_EINSUM_DENSE = lora_rule("lora_einsum_dense")
LORA_EMBEDDING = lora_rule("lora_embedding")

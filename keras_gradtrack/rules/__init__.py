"""Per-layer rules, registered per layer class in one place.

A rule turns one layer's taps (its inputs and the per-example gradients at its
pre-activation output) into the per-example primitives: without building
per-example gradient tensors, or, where those are as cheap as the batch gradient
(small parameters, long sequences, convolutions), by building them and taking
the batch gradient as their sum. Layers without a rule use the engine's exact,
vectorized per-layer fallback; `model.gradient_tracking_summary()` says which.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.rules import (
    conv,
    conv_transpose,
    dense,
    einsum,
    embedding,
    normalization,
    separable_conv,
)
from keras_gradtrack.rules.base import (
    LayerPrimitives,
    PerExampleFn,
    Reference,
    Rule,
    RuleFn,
    primitives_of,
)

CONV = Rule(
    "conv",
    conv.conv_primitives,
    conv.conv_applies,
    per_example=conv.conv_per_example,
    materializes=conv.conv_materializes,
)
DEPTHWISE_CONV = Rule(
    "depthwise_conv",
    conv.depthwise_primitives,
    conv.conv_applies,
    per_example=conv.depthwise_per_example,
    materializes=conv.depthwise_materializes,
)
SEPARABLE_CONV = Rule(
    "separable_conv",
    separable_conv.separable_primitives,
    conv.conv_applies,
    per_example=separable_conv.separable_per_example,
    materializes=separable_conv.separable_materializes,
)
CONV_TRANSPOSE = Rule(
    "conv_transpose",
    conv_transpose.conv_transpose_primitives,
    conv_transpose.conv_transpose_applies,
    per_example=conv_transpose.conv_transpose_per_example,
    materializes=conv_transpose.conv_transpose_materializes,
)


def normalization_rule(name: str, per_example: PerExampleFn, applies: Any) -> Rule:
    """Normalization parameters are as small per example as in total: always materialized."""
    return Rule(
        name,
        primitives_of(per_example),
        applies,
        split_activation=False,
        per_example=per_example,
    )


RULES: dict[type, Rule] = {
    keras.layers.Dense: Rule(
        "dense",
        dense.dense_primitives,
        dense.dense_applies,
        gram=dense.dense_gram,
        per_example=dense.dense_per_example,
        materializes=dense.dense_materializes,
    ),
    keras.layers.Conv1D: CONV,
    keras.layers.Conv2D: CONV,
    keras.layers.Conv3D: CONV,
    keras.layers.DepthwiseConv1D: DEPTHWISE_CONV,
    keras.layers.DepthwiseConv2D: DEPTHWISE_CONV,
    keras.layers.SeparableConv1D: SEPARABLE_CONV,
    keras.layers.SeparableConv2D: SEPARABLE_CONV,
    keras.layers.Conv1DTranspose: CONV_TRANSPOSE,
    keras.layers.Conv2DTranspose: CONV_TRANSPOSE,
    keras.layers.Conv3DTranspose: CONV_TRANSPOSE,
    keras.layers.Embedding: Rule(
        "embedding",
        embedding.embedding_primitives,
        embedding.embedding_applies,
        split_activation=False,
    ),
    keras.layers.LayerNormalization: normalization_rule(
        "layer_normalization",
        normalization.layer_normalization_per_example,
        normalization.layer_normalization_applies,
    ),
    keras.layers.GroupNormalization: normalization_rule(
        "group_normalization",
        normalization.group_normalization_per_example,
        normalization.group_normalization_applies,
    ),
    keras.layers.RMSNormalization: normalization_rule(
        "rms_normalization",
        normalization.rms_normalization_per_example,
        normalization.rms_normalization_applies,
    ),
    keras.layers.EinsumDense: Rule(
        "einsum_dense",
        einsum.einsum_dense_primitives,
        einsum.einsum_dense_applies,
        per_example=einsum.einsum_dense_per_example,
        materializes=einsum.einsum_dense_materializes,
    ),
}


def rule_for(layer: Any) -> Rule | None:
    """The rule registered for the layer's exact class, if it applies to this instance."""
    rule = RULES.get(type(layer))
    if rule is None or not rule.applies(layer):
        return None
    return rule


__all__ = ["RULES", "LayerPrimitives", "Reference", "Rule", "RuleFn", "rule_for"]

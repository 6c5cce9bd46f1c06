"""Per-layer rules, registered per layer class in one place.

A rule turns one layer's taps (its inputs and the per-example gradients at its
pre-activation output) into the per-example primitives without building
per-example gradient tensors. Layers without a rule use the engine's exact,
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
from keras_gradtrack.rules.base import LayerPrimitives, ReferenceFn, Rule, RuleFn

RULES: dict[type, Rule] = {
    keras.layers.Dense: Rule(
        "dense", dense.dense_primitives, dense.dense_applies, gram=dense.dense_gram
    ),
    # -- convolutions --
    keras.layers.Conv1D: Rule("conv", conv.conv_primitives, conv.conv_applies, gram=conv.conv_gram),
    keras.layers.Conv2D: Rule("conv", conv.conv_primitives, conv.conv_applies, gram=conv.conv_gram),
    keras.layers.Conv3D: Rule("conv", conv.conv_primitives, conv.conv_applies, gram=conv.conv_gram),
    keras.layers.DepthwiseConv1D: Rule(
        "depthwise_conv", conv.depthwise_primitives, conv.conv_applies, gram=conv.depthwise_gram
    ),
    keras.layers.DepthwiseConv2D: Rule(
        "depthwise_conv", conv.depthwise_primitives, conv.conv_applies, gram=conv.depthwise_gram
    ),
    keras.layers.SeparableConv1D: Rule(
        "separable_conv",
        separable_conv.separable_primitives,
        conv.conv_applies,
        gram=separable_conv.separable_gram,
    ),
    keras.layers.SeparableConv2D: Rule(
        "separable_conv",
        separable_conv.separable_primitives,
        conv.conv_applies,
        gram=separable_conv.separable_gram,
    ),
    keras.layers.Conv1DTranspose: Rule(
        "conv_transpose",
        conv_transpose.conv_transpose_primitives,
        conv_transpose.conv_transpose_applies,
        gram=conv_transpose.conv_transpose_gram,
    ),
    keras.layers.Conv2DTranspose: Rule(
        "conv_transpose",
        conv_transpose.conv_transpose_primitives,
        conv_transpose.conv_transpose_applies,
        gram=conv_transpose.conv_transpose_gram,
    ),
    keras.layers.Conv3DTranspose: Rule(
        "conv_transpose",
        conv_transpose.conv_transpose_primitives,
        conv_transpose.conv_transpose_applies,
        gram=conv_transpose.conv_transpose_gram,
    ),
    # -- embeddings, normalization, einsum --
    keras.layers.Embedding: Rule(
        "embedding",
        embedding.embedding_primitives,
        embedding.embedding_applies,
        split_activation=False,
    ),
    keras.layers.LayerNormalization: Rule(
        "layer_normalization",
        normalization.layer_normalization_primitives,
        normalization.layer_normalization_applies,
        split_activation=False,
    ),
    keras.layers.GroupNormalization: Rule(
        "group_normalization",
        normalization.group_normalization_primitives,
        normalization.group_normalization_applies,
        split_activation=False,
    ),
    keras.layers.RMSNormalization: Rule(
        "rms_normalization",
        normalization.rms_normalization_primitives,
        normalization.rms_normalization_applies,
        split_activation=False,
    ),
    keras.layers.EinsumDense: Rule(
        "einsum_dense", einsum.einsum_dense_primitives, einsum.einsum_dense_applies
    ),
}


def rule_for(layer: Any) -> Rule | None:
    """The rule registered for the layer's exact class, if it applies to this instance."""
    rule = RULES.get(type(layer))
    if rule is None or not rule.applies(layer):
        return None
    return rule


__all__ = ["RULES", "LayerPrimitives", "ReferenceFn", "Rule", "RuleFn", "rule_for"]

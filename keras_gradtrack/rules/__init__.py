"""Per-layer rules, registered per layer class in one place.

A rule turns one layer's taps (its inputs and the per-example gradients at its
pre-activation output) into the per-example primitives without building
per-example gradient tensors. Layers without a rule use the engine's exact,
vectorized per-layer fallback; `model.gradient_tracking_summary()` says which.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.rules import dense, einsum, embedding, normalization
from keras_gradtrack.rules.base import LayerPrimitives, ReferenceFn, Rule, RuleFn

RULES: dict[type, Rule] = {
    keras.layers.Dense: Rule(
        "dense", dense.dense_primitives, dense.dense_applies, gram=dense.dense_gram
    ),
    # -- convolutions --
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

"""The JAX engine's seam to Keras' internals: every private Keras name it uses.

It imports nothing of TensorFlow (the TensorFlow engine's seam,
`keras_gradtrack._keras_seam`, does), so the JAX engine runs where TensorFlow is
not installed.
"""

from __future__ import annotations

from typing import Any

from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments

__all__ = [
    "Functional",
    "LossFunctionWrapper",
    "flatten_layers",
    "functional_init_arguments",
    "own_trainable_variables",
    "update_metrics_variables",
]


def flatten_layers(model: Any, include_self: bool = True) -> list[Any]:
    """Every layer of `model`, outer layers first (`Layer._flatten_layers`)."""
    return list(model._flatten_layers(include_self=include_self))


def own_trainable_variables(layer: Any) -> list[Any]:
    """The trainable variables `layer` created itself, not its sublayers'."""
    return list(layer._trainable_variables)


def update_metrics_variables(
    model: Any,
    metrics_variables: Any,
    unscaled_loss: Any,
    x: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
) -> tuple[Any, Any]:
    """`(logs, metrics_variables)` after the step, as Keras' JAX `train_step` computes them."""
    return model._update_metrics_variables(
        metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )

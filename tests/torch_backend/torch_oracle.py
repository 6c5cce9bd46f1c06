"""The PyTorch engine's oracle: `torch.autograd.grad` of each example's loss alone, then
every statistic by its textbook definition (`backend_oracle.statistics_of`, float64).

For example i, `l_i` is the compiled loss on that example alone (with its sample
weight) and `g_i = d l_i / d theta`; the layers are the owners of
`model.trainable_variables` (read from the variables' paths, not from the engine's
plan). `G` is the gradient of the compiled loss on the whole batch plus the model's
weight penalties: the gradient the optimizer receives.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import torch
from backend_oracle import layer_columns, statistics_of
from tolerance import assert_matches_oracle  # noqa: F401 (the one tolerance rule)

from keras_gradtrack._keras_seam import LossFunctionWrapper


def loss_function(model: Any) -> Any:
    loss = keras.losses.get(model.loss) if isinstance(model.loss, str) else model.loss
    if not isinstance(loss, keras.losses.Loss):
        loss = LossFunctionWrapper(loss)
    return loss


def take(data: Any, i: int) -> Any:
    return keras.tree.map_structure(lambda a: np.asarray(a)[i : i + 1], data)


def loss_value(model: Any, x: Any, y: Any, sample_weight: Any, penalties: bool = False) -> Any:
    y_pred = model(x, training=True)
    loss = loss_function(model)
    value = loss(y, y_pred) if sample_weight is None else loss(y, y_pred, sample_weight)
    return value + sum(model.losses) if penalties and model.losses else value


def gradients(value: Any, model: Any) -> list[np.ndarray]:
    grads = torch.autograd.grad(value, [v.value for v in model.trainable_variables])
    return [g.detach().cpu().numpy().astype(np.float64).ravel() for g in grads]


def per_example_gradients(model: Any, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
    """`l` (B,), `g` per layer (B, n_k) and `G` per layer, one backward pass per example."""
    batch = len(keras.tree.flatten(x)[0])
    losses, rows = [], []
    for i in range(batch):
        weight = None if sample_weight is None else take(sample_weight, i)
        value = loss_value(model, take(x, i), take(y, i), weight)
        losses.append(float(value.detach()))
        rows.append(gradients(value, model))
    full = gradients(loss_value(model, x, y, sample_weight, penalties=True), model)
    columns = layer_columns(model)
    g = [np.stack([np.concatenate([row[p] for p in ps]) for row in rows]) for ps in columns]
    G = [np.concatenate([full[p] for p in ps]) for ps in columns]
    return {"loss": np.asarray(losses), "g": g, "G": G}


def oracle_statistics(model: Any, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
    """Every built-in statistic by its definition, and `pairwise_cosine`."""
    return statistics_of(per_example_gradients(model, x, y, sample_weight))

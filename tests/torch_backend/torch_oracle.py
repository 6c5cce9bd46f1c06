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


def loss_value(
    model: Any, x: Any, y: Any, sample_weight: Any, penalties: bool = False, loss: Any = None
) -> Any:
    """The compiled loss of the batch (or `loss(y, y_pred, sample_weight)`, the compiled
    loss written out); with `penalties`, plus the model's own losses."""
    x, y, sample_weight = (tensors(value) for value in (x, y, sample_weight))
    y_pred = model(x, training=True)
    if loss is not None:
        value = loss(y, y_pred, sample_weight)
    else:
        compiled = loss_function(model)
        value = compiled(y, y_pred) if sample_weight is None else compiled(y, y_pred, sample_weight)
    return value + sum(model.losses) if penalties and model.losses else value


def tensors(value: Any) -> Any:
    return None if value is None else keras.tree.map_structure(keras.ops.convert_to_tensor, value)


def gradients(value: Any, model: Any) -> list[np.ndarray]:
    grads = torch.autograd.grad(value, [v.value for v in model.trainable_variables])
    return [g.detach().cpu().numpy().astype(np.float64).ravel() for g in grads]


def per_example_gradients(
    model: Any, x: Any, y: Any, sample_weight: Any = None, loss: Any = None
) -> dict[str, Any]:
    """`l` (B,), `g` per layer (B, n_k) and `G` per layer, one backward pass per example."""
    batch = len(keras.tree.flatten(x)[0])
    losses, rows = [], []
    for i in range(batch):
        weight = None if sample_weight is None else take(sample_weight, i)
        value = loss_value(model, take(x, i), take(y, i), weight, loss=loss)
        losses.append(float(value.detach()))
        rows.append(gradients(value, model))
    full = gradients(loss_value(model, x, y, sample_weight, penalties=True, loss=loss), model)
    columns = layer_columns(model)
    g = [np.stack([np.concatenate([row[p] for p in ps]) for row in rows]) for ps in columns]
    G = [np.concatenate([full[p] for p in ps]) for ps in columns]
    return {"loss": np.asarray(losses), "g": g, "G": G}


def oracle_statistics(
    model: Any, x: Any, y: Any, sample_weight: Any = None, loss: Any = None
) -> dict[str, Any]:
    """Every built-in statistic by its definition, and `pairwise_cosine`."""
    return statistics_of(per_example_gradients(model, x, y, sample_weight, loss))


def input_grad_norms(
    model: Any, x: Any, y: Any, sample_weight: Any = None, loss: Any = None
) -> np.ndarray:
    """`(B,)` `||d l_i / d x_i||` over the float inputs, one backward pass per example."""
    batch = len(keras.tree.flatten(x)[0])
    norms = []
    for i in range(batch):
        weight = None if sample_weight is None else take(sample_weight, i)
        inputs = keras.tree.map_structure(lambda a: torch.tensor(a, requires_grad=True), take(x, i))
        value = loss_value(model, inputs, take(y, i), weight, loss=loss)
        grads = torch.autograd.grad(value, keras.tree.flatten(inputs))
        norms.append(np.sqrt(sum(np.sum(g.cpu().numpy().astype(np.float64) ** 2) for g in grads)))
    return np.asarray(norms)

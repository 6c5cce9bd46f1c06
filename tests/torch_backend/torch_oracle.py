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
from torch.utils._python_dispatch import TorchDispatchMode

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
    variables = [v.value for v in model.trainable_variables]
    grads = torch.autograd.grad(value, variables, retain_graph=True, allow_unused=True)
    return [
        np.zeros(v.numel()) if g is None else g.detach().cpu().numpy().astype(np.float64).ravel()
        for v, g in zip(variables, grads)
    ]


def full_batch_losses(model: Any, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any]:
    """`((B,), loss)`: each example's compiled loss on its row of the full batch's
    forward pass (in training mode, where BatchNormalization normalizes with the batch's
    moments), and the batch's loss on it with the weight penalties (the model's state,
    moving moments and seeds, left as it was)."""
    mapping = [(v, v.value) for v in model.trainable_variables] + [
        (v, v.value.detach().clone()) for v in model.non_trainable_variables
    ]
    compiled = loss_function(model)
    with keras.StatelessScope(state_mapping=mapping):
        y_pred = model(tensors(x), training=True)
        weights = tensors(sample_weight)
        batch_loss = compiled(tensors(y), y_pred, weights)
        batch_loss = batch_loss + sum(model.losses) if model.losses else batch_loss
    values = []
    for i in range(len(keras.tree.flatten(x)[0])):
        yi, pi = tensors(take(y, i)), y_pred[i : i + 1]
        weight = None if sample_weight is None else tensors(take(sample_weight, i))
        values.append(compiled(yi, pi) if weight is None else compiled(yi, pi, weight))
    return torch.stack(values), batch_loss


def per_example_gradients(
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    loss: Any = None,
    full_batch: bool = False,
) -> dict[str, Any]:
    """`l` (B,), `g` per layer (B, n_k) and `G` per layer, one backward pass per example
    (`full_batch`: of each example's loss on its row of the full batch's forward pass,
    the other examples held fixed)."""
    batch = len(keras.tree.flatten(x)[0])
    losses, rows = [], []
    values, batch_loss = (
        full_batch_losses(model, x, y, sample_weight) if full_batch else (None, None)
    )
    for i in range(batch):
        if values is None:
            weight = None if sample_weight is None else take(sample_weight, i)
            value = loss_value(model, take(x, i), take(y, i), weight, loss=loss)
        else:
            value = values[i]
        losses.append(float(value.detach()))
        rows.append(gradients(value, model))
    if batch_loss is None:
        batch_loss = loss_value(model, x, y, sample_weight, penalties=True, loss=loss)
    full = gradients(batch_loss, model)
    columns = layer_columns(model)
    g = [np.stack([np.concatenate([row[p] for p in ps]) for row in rows]) for ps in columns]
    G = [np.concatenate([full[p] for p in ps]) for ps in columns]
    return {"loss": np.asarray(losses), "g": g, "G": G}


def oracle_statistics(
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    loss: Any = None,
    full_batch: bool = False,
) -> dict[str, Any]:
    """Every built-in statistic by its definition, and `pairwise_cosine` (`full_batch`:
    see `per_example_gradients`)."""
    return statistics_of(per_example_gradients(model, x, y, sample_weight, loss, full_batch))


def target_gradients(model: Any, x: Any, y: Any) -> np.ndarray:
    """`(T, P)` each target's gradient over all variables (in the order of
    `per_example_gradients`' layers): `l_j` the compiled loss on target j alone, in
    inference mode, without sample weight or penalties."""
    rows = []
    for j in range(len(keras.tree.flatten(x)[0])):
        value = loss_function(model)(
            tensors(take(y, j)), model(tensors(take(x, j)), training=False)
        )
        flat = gradients(value, model)
        rows.append(np.concatenate([flat[p] for ps in layer_columns(model) for p in ps]))
    return np.stack(rows)


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


class CountedProducts(TorchDispatchMode):
    """Counts the matrix products (and convolutions) torch runs while it is on."""

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.count += 1
        return func(*args, **(kwargs or {}))

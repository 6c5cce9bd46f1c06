"""The JAX engine's oracle: `jax.grad` of each example's loss alone, then every
statistic by its textbook definition (in float64, from float32 gradients).

For example i, `l_i` is the compiled loss on that example alone (with its sample
weight) and `g_i = d l_i / d theta`; the layers are the owners of
`model.trainable_variables` (read from the variables' paths, not from the
engine's plan). `G` is the gradient of the compiled loss on the whole batch, plus
the model's weight penalties: the gradient the optimizer receives (unscaled). A model
compiled with several losses or loss weights gives its loss as a function
(`loss=`, `(y, y_pred, sample_weight) -> scalar`, written out by the test).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import keras
import numpy as np
from backend_oracle import layer_columns, statistics_of
from tolerance import assert_matches_oracle  # noqa: F401 (the one tolerance rule)

from keras_gradtrack._keras_seam import LossFunctionWrapper


def _loss_function(model: Any) -> Any:
    """The compiled loss as `compile` reduces it: a name or a function of the examples'
    values wrapped with the default reduction (`sum_over_batch_size`), as Keras does."""
    loss = keras.losses.get(model.loss) if isinstance(model.loss, str) else model.loss
    if not isinstance(loss, keras.losses.Loss):
        loss = LossFunctionWrapper(loss)
    return loss


def _loss(
    model: Any,
    trainable: Any,
    x: Any,
    y: Any,
    sample_weight: Any,
    penalties: bool = False,
    loss: Any = None,
) -> Any:
    """The compiled loss of the batch; with `penalties`, plus the model's own losses
    (weight regularization: the loss whose gradient the optimizer receives)."""
    non_trainable = [v.value for v in model.non_trainable_variables]
    kwargs = {"training": True} if "training" in inspect.signature(model.call).parameters else {}
    y_pred, _, losses = model.stateless_call(
        trainable, non_trainable, x, return_losses=True, **kwargs
    )
    if loss is not None:
        value = loss(y, y_pred, sample_weight)
        return value + sum(losses) if penalties else value
    loss = _loss_function(model)
    if sample_weight is None:
        value = loss(y, y_pred)
    else:
        value = loss(y, y_pred, sample_weight=sample_weight)
    return value + sum(losses) if penalties else value


def take(data: Any, i: int) -> Any:
    return keras.tree.map_structure(lambda a: np.asarray(a)[i : i + 1], data)


def full_batch_losses(model: Any, trainable: Any, x: Any, y: Any, sample_weight: Any) -> Any:
    """`(B,)`: each example's compiled loss on its row of the full batch's forward pass
    (in training mode, where BatchNormalization normalizes with the batch's moments)."""
    non_trainable = [v.value for v in model.non_trainable_variables]
    y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
    loss = _loss_function(model)
    batch = len(keras.tree.flatten(x)[0])
    values = []
    for i in range(batch):
        weight = None if sample_weight is None else take(sample_weight, i)
        values.append(loss(take(y, i), y_pred[i : i + 1], sample_weight=weight))
    return jax.numpy.stack(values)


def per_example_gradients(
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    full_batch: bool = False,
    loss: Any = None,
) -> dict[str, Any]:
    """`l` (B,), `g` per layer (B, n_k) and `G` per layer, from one `jax.grad` per example
    (`full_batch`: the rows of `jax.jacrev` of the full batch's per-example losses, the
    other examples held fixed)."""
    trainable = [v.value for v in model.trainable_variables]
    batch = len(keras.tree.flatten(x)[0])

    losses, rows = [], []
    if full_batch:
        values = full_batch_losses(model, trainable, x, y, sample_weight)
        jacobian = jax.jacrev(lambda t: full_batch_losses(model, t, x, y, sample_weight))(trainable)
        losses = [float(v) for v in values]
        rows = [[np.asarray(j[i], np.float64).ravel() for j in jacobian] for i in range(batch)]
    else:
        # Compiled once for the batch's examples (they share a shape): eager JAX would
        # trace and compile a recurrent layer's `lax.scan` again for every example.
        value_and_grad = jax.jit(
            jax.value_and_grad(lambda t, xi, yi, wi: _loss(model, t, xi, yi, wi, loss=loss))
        )
        for i in range(batch):
            weight = None if sample_weight is None else take(sample_weight, i)
            value, grads = value_and_grad(trainable, take(x, i), take(y, i), weight)
            losses.append(float(value))
            rows.append([np.asarray(g, np.float64).ravel() for g in grads])
    full = jax.grad(lambda t: _loss(model, t, x, y, sample_weight, penalties=True, loss=loss))(
        trainable
    )
    columns = layer_columns(model)
    g = [np.stack([np.concatenate([row[p] for p in ps]) for row in rows]) for ps in columns]
    G = [np.concatenate([np.asarray(full[p], np.float64).ravel() for p in ps]) for ps in columns]
    return {"loss": np.asarray(losses), "g": g, "G": G}


def target_gradients(model: Any, x: Any, y: Any) -> np.ndarray:
    """`(T, P)` each target's gradient over all variables (in the order of
    `per_example_gradients`' layers): `l_j` the compiled loss on target j alone, in
    inference mode, without sample weight or penalties."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(values: Any, xj: Any, yj: Any) -> Any:
        kwargs = (
            {"training": False} if "training" in inspect.signature(model.call).parameters else {}
        )
        y_pred, _ = model.stateless_call(values, non_trainable, xj, **kwargs)
        return _loss_function(model)(yj, y_pred)

    def take(data: Any, j: int) -> Any:
        return keras.tree.map_structure(lambda a: np.asarray(a)[j : j + 1], data)

    rows = []
    grad = jax.jit(jax.grad(loss))  # compiled once for the targets (they share a shape)
    for j in range(len(keras.tree.flatten(x)[0])):
        grads = grad(trainable, take(x, j), take(y, j))
        flat = [np.asarray(g, np.float64).ravel() for g in grads]
        rows.append(np.concatenate([flat[p] for ps in layer_columns(model) for p in ps]))
    return np.stack(rows)


def input_grad_norms(
    model: Any, x: Any, y: Any, sample_weight: Any = None, loss: Any = None
) -> np.ndarray:
    """`(B,)` `||d l_i / d x_i||` over the float inputs, one `jax.grad` per example."""
    trainable = [v.value for v in model.trainable_variables]
    batch = len(keras.tree.flatten(x)[0])
    grad = jax.jit(jax.grad(lambda xi, yi, wi: _loss(model, trainable, xi, yi, wi, loss=loss)))
    norms = []
    for i in range(batch):
        weight = None if sample_weight is None else take(sample_weight, i)
        grads = keras.tree.flatten(grad(take(x, i), take(y, i), weight))
        norms.append(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads)))
    return np.asarray(norms)


def oracle_statistics(
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    full_batch: bool = False,
    loss: Any = None,
) -> dict[str, Any]:
    """Every built-in statistic by its definition, and `pairwise_cosine` (`full_batch`:
    see `per_example_gradients`)."""
    found = per_example_gradients(model, x, y, sample_weight, full_batch, loss)
    return statistics_of(found)

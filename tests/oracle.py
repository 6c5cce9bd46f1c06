"""The one oracle for every correctness test: a fresh GradientTape per example.

For example i, `l_i` is the compiled loss on that example alone (with its
sample weight; a "mean_with_sample_weight" loss with weights is summed, as the
weights would otherwise cancel) and `g_i = d l_i / d theta`, flattened per
layer, in float64. The layers are the owners of `model.trainable_variables`, in
that order, read from the variables' paths (not from the engine's plan). `G` is
the gradient Keras' own train step would hand the optimizer for the whole batch
(regularization included). Every statistic is then computed from these by its
textbook definition.

With BatchNormalization in training mode (`full_batch=True`), example i's loss
depends on the whole batch, and a batch-of-one forward would change the
statistics: `g_i` is then the gradient of `l_i` taken from the full-batch
forward (one tape, a gradient per example), the other examples held fixed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from sketch_oracle import oracle_sketches  # noqa: F401 (re-exported)
from tolerance import COSINE_ATOL, RTOL, assert_matches_oracle  # noqa: F401 (re-exported)


def _dense(gradient: Any, variable: Any) -> np.ndarray:
    if gradient is None:
        return np.zeros(np.prod(variable.shape), np.float64)
    return np.asarray(tf.convert_to_tensor(gradient), np.float64).ravel()


def _take(data: Any, index: int) -> Any:
    return tree.map_structure(
        lambda a: None if a is None else np.asarray(a)[index : index + 1], data
    )


def layer_columns(model: Any) -> tuple[list[str], dict[int, int]]:
    """The owning layers' names, in order of `model.trainable_variables`, and each
    variable's column; checked against the engine's column names.

    A Keras recurrent layer owns its cell's variables (its loop is the layer's)."""
    recurrent: dict[int, str] = {}
    for layer in model._flatten_layers(include_self=False):  # outer layers first
        if isinstance(layer, keras.layers.RNN):
            for variable in layer.trainable_variables:
                recurrent.setdefault(id(variable), layer.path)
    owners: list[str] = []
    column = {}
    for variable in model.trainable_variables:
        owner = recurrent.get(id(variable), variable.path.rpartition("/")[0])
        if owner not in owners:
            owners.append(owner)
        column[id(variable)] = owners.index(owner)
    names: list[str] = []
    for owner in owners:
        # Layers of the same name are numbered: x, x_1, ...
        name, suffix = owner.rpartition("/")[2], 0
        while (name if not suffix else f"{name}_{suffix}") in names:
            suffix += 1
        names.append(name if not suffix else f"{name}_{suffix}")
    assert names == model.tracked_layer_names, (names, model.tracked_layer_names)
    return names, column


@contextlib.contextmanager
def summed_weighted_means(model: Any, sample_weight: Any) -> Any:
    """Per example, a "mean_with_sample_weight" loss with weights is their weighted sum."""
    changed = []
    if sample_weight is not None:
        # Built by the full-batch loss, which the oracle computes first.
        for entry in model._compile_loss._flat_losses:
            if entry.loss.reduction == "mean_with_sample_weight":
                entry.loss.reduction = "sum"
                changed.append(entry.loss)
    try:
        yield
    finally:
        for loss in changed:
            loss.reduction = "mean_with_sample_weight"


def per_example_gradients(
    model: Any, x: Any, y: Any, sample_weight: Any = None, full_batch: bool = False
) -> dict[str, Any]:
    """Per-example losses and per-layer gradients, one tape per example (or, with
    `full_batch`, one gradient per example of the full-batch forward)."""
    names, column = layer_columns(model)
    variables = list(model.trainable_variables)
    batch = len(tree.flatten(x)[0])
    losses = np.zeros(batch)
    input_norms = np.zeros(batch)
    per_layer = [[] for _ in names]
    # A forward in training mode updates state (moving statistics) that batch
    # renormalization reads: every forward starts from the state of the first.
    state = [(v, v.numpy()) for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        prediction = model(x, training=True)
        total = model._compute_loss(x=x, y=y, y_pred=prediction, sample_weight=sample_weight)
    batch_gradients = tape.gradient(total, variables)
    for variable, value in state:
        variable.assign(value)
    for i, (loss, gradients, input_gradients) in enumerate(
        _full_batch_examples(model, x, y, sample_weight)
        if full_batch
        else _single_examples(model, x, y, sample_weight)
    ):
        input_norms[i] = np.sqrt(
            sum(
                float(np.sum(np.asarray(g, np.float64) ** 2))
                for g in input_gradients
                if g is not None
            )
        )
        losses[i] = float(loss)
        flat = [[] for _ in names]
        for variable, gradient in zip(variables, gradients):
            flat[column[id(variable)]].append(_dense(gradient, variable))
        for k in range(len(names)):
            per_layer[k].append(np.concatenate(flat[k]))
    reference = [[] for _ in names]
    for variable, gradient in zip(variables, batch_gradients):
        reference[column[id(variable)]].append(_dense(gradient, variable))
    return {
        "layers": names,
        "loss": losses,
        "input_grad_norm": input_norms,
        "g": [np.stack(rows) for rows in per_layer],  # L arrays of (B, P_k)
        "G": [np.concatenate(parts) for parts in reference],  # L arrays of (P_k,)
    }


def _single_examples(model: Any, x: Any, y: Any, sample_weight: Any) -> Any:
    """`(l_i, d l_i / d theta, d l_i / d x_i)` from a forward of example i alone."""
    variables = list(model.trainable_variables)
    for i in range(len(tree.flatten(x)[0])):
        xi = tree.map_structure(tf.convert_to_tensor, _take(x, i))
        yi = _take(y, i)
        wi = None if sample_weight is None else _take(sample_weight, i)
        float_inputs = [t for t in tree.flatten(xi) if t.dtype.is_floating]
        with tf.GradientTape(persistent=True) as tape, summed_weighted_means(model, wi):
            tape.watch(float_inputs)
            prediction = model(xi, training=True)
            loss = model._compile_loss(yi, prediction, wi)
        yield loss, tape.gradient(loss, variables), tape.gradient(loss, float_inputs)
        del tape


def _full_batch_examples(model: Any, x: Any, y: Any, sample_weight: Any) -> Any:
    """`(l_i, d l_i / d theta, d l_i / d x_i)` from one forward of the whole batch."""
    variables = list(model.trainable_variables)
    x = tree.map_structure(tf.convert_to_tensor, x)
    float_inputs = [t for t in tree.flatten(x) if t.dtype.is_floating]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(float_inputs)
        prediction = model(x, training=True)
        losses = []
        for i in range(len(tree.flatten(x)[0])):
            wi = None if sample_weight is None else _take(sample_weight, i)
            with summed_weighted_means(model, wi):
                losses.append(
                    model._compile_loss(
                        _take(y, i), tree.map_structure(lambda p, i=i: p[i : i + 1], prediction), wi
                    )
                )
    for i, loss in enumerate(losses):
        # Only example i's own rows of the input gradient: d l_i / d x_i.
        own_inputs = [
            None if g is None else np.asarray(g)[i] for g in tape.gradient(loss, float_inputs)
        ]
        yield loss, tape.gradient(loss, variables), own_inputs
    del tape


def oracle_from_losses(
    model: Any, per_example_loss: Any, x: Any, variables: Any = None
) -> dict[str, Any]:
    """Every statistic by its definition for `l_i = per_example_loss(model, x_i)` and
    `G` the gradient of the batch's mean loss, over `variables` (default: all trainable).

    Per-layer values cover the layers owning `variables`, in the engine's column order.
    """
    names, column = layer_columns(model)
    variables = list(model.trainable_variables if variables is None else variables)
    covered = sorted({column[id(v)] for v in variables})
    batch = len(tree.flatten(x)[0])
    losses, per_layer = np.zeros(batch), [[] for _ in covered]
    for i in range(batch):
        xi = tree.map_structure(tf.convert_to_tensor, _take(x, i))
        with tf.GradientTape() as tape:
            loss = tf.reshape(per_example_loss(model, xi), [])
        gradients = tape.gradient(loss, variables)
        losses[i] = float(loss)
        flat: list[list[np.ndarray]] = [[] for _ in covered]
        for variable, gradient in zip(variables, gradients):
            flat[covered.index(column[id(variable)])].append(_dense(gradient, variable))
        for k in range(len(covered)):
            per_layer[k].append(np.concatenate(flat[k]))
    with tf.GradientTape() as tape:
        total = tf.reduce_mean(per_example_loss(model, tree.map_structure(tf.convert_to_tensor, x)))
    reference: list[list[np.ndarray]] = [[] for _ in covered]
    for variable, gradient in zip(variables, tape.gradient(total, variables)):
        reference[covered.index(column[id(variable)])].append(_dense(gradient, variable))
    found = {
        "layers": [names[k] for k in covered],
        "loss": losses,
        "input_grad_norm": np.full(batch, np.nan),
        "g": [np.stack(rows) for rows in per_layer],
        "G": [np.concatenate(parts) for parts in reference],
    }
    with np.errstate(invalid="ignore", divide="ignore"):
        return _statistics(found)


def oracle_statistics(
    model: Any, x: Any, y: Any, sample_weight: Any = None, full_batch: bool = False
) -> dict[str, Any]:
    """Every built-in statistic by its definition, from the per-example tapes (with
    `full_batch`, from the full-batch forward: BatchNormalization in training mode)."""
    found = per_example_gradients(model, x, y, sample_weight, full_batch)
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero gradient has NaN cosine
        return _statistics(found)


def _statistics(found: dict[str, Any]) -> dict[str, Any]:
    g = np.concatenate(found["g"], axis=1)
    G = np.concatenate(found["G"])
    batch = g.shape[0]
    norms = np.linalg.norm(g, axis=1)
    layer_norms = np.stack([np.linalg.norm(gk, axis=1) for gk in found["g"]], axis=1)
    layer_cosine = np.stack(
        [
            gk @ Gk / (np.linalg.norm(gk, axis=1) * np.linalg.norm(Gk))
            for gk, Gk in zip(found["g"], found["G"])
        ],
        axis=1,
    )
    cosine = g @ G / (norms * np.linalg.norm(G))
    summed = g.sum(axis=0)
    mean = summed / batch
    trace = ((g - mean) ** 2).sum() / (batch - 1) if batch > 1 else np.nan
    return {
        "layers": found["layers"],
        "loss": found["loss"],
        "input_grad_norm": found["input_grad_norm"],
        "grad_norm": norms,
        "cosine": cosine,
        "layer_grad_norm": layer_norms,
        "layer_cosine": layer_cosine,
        "batch_grad_norm": np.linalg.norm(G),
        "gradient_diversity": (norms**2).sum() / (summed**2).sum(),
        "noise_scale": trace / (mean**2).sum(),
        "mean_cosine": np.nanmean(cosine),
        "frac_negative_cosine": np.mean(cosine < 0),
        "pairwise_cosine": (g @ g.T) / np.outer(norms, norms),
        "per_example_gradients": g,
    }


def target_gradients(model: Any, x: Any, y: Any) -> np.ndarray:
    """`(T, P)` each target's gradient over all layers (in the oracle's layer order):
    `l_j` the compiled loss on target j alone, in inference mode, no sample weight."""
    names, column = layer_columns(model)
    variables = list(model.trainable_variables)
    rows = []
    for j in range(len(tree.flatten(x)[0])):
        xj = tree.map_structure(tf.convert_to_tensor, _take(x, j))
        with tf.GradientTape() as tape:
            loss = model._compile_loss(_take(y, j), model(xj, training=False))
        flat: list[list[np.ndarray]] = [[] for _ in names]
        for variable, gradient in zip(variables, tape.gradient(loss, variables)):
            flat[column[id(variable)]].append(_dense(gradient, variable))
        rows.append(np.concatenate([part for parts in flat for part in parts]))
    return np.stack(rows)


def oracle_target_products(
    model: Any, x: Any, y: Any, sample_weight: Any, x_targets: Any, y_targets: Any
) -> np.ndarray:
    """`(B, T)` `<g_i, g_target_j>`: the batch's per-example gradients (training mode,
    as `per_example_gradients`) with the targets' (`target_gradients`)."""
    batch = np.concatenate(per_example_gradients(model, x, y, sample_weight)["g"], axis=1)
    return batch @ target_gradients(model, x_targets, y_targets).T

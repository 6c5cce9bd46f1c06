"""What the probed engines' oracles share (JAX, PyTorch): the statistics by their
textbook definitions from each example's gradient, and a tracked step against plain
Keras. Each backend's oracle gives the gradients (`jax_backend/jax_oracle.py`,
`torch_backend/torch_oracle.py`), in its own autodiff, one example at a time.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_gradtrack._keras_seam import flatten_layers


def unseen_by_the_loss(model: Any) -> set[int]:
    """Ids of the variables whose exact gradient is zero whatever the data: attention's
    key bias (it adds the same score to every key of a query, which the softmax over
    the keys does not see)."""
    return {
        id(layer._key_dense.bias)
        for layer in flatten_layers(model, include_self=False)
        if isinstance(layer, keras.layers.MultiHeadAttention) and layer._key_dense.bias is not None
    }


def layer_columns(model: Any) -> list[list[int]]:
    """Positions in `model.trainable_variables` of each owning layer's variables; a
    recurrent layer owns its cell's (stacked cells' alike: one column, as on TensorFlow)."""
    recurrent = {}
    for layer in flatten_layers(model, include_self=False):
        if isinstance(layer, keras.layers.RNN):
            for variable in layer.trainable_variables:
                recurrent.setdefault(id(variable), layer.path)
    owners: dict[str, list[int]] = {}
    for position, variable in enumerate(model.trainable_variables):
        owner = recurrent.get(id(variable), variable.path.rpartition("/")[0])
        owners.setdefault(owner, []).append(position)
    return list(owners.values())


def statistics_of(found: dict[str, Any]) -> dict[str, Any]:
    """Every built-in statistic by its definition, and `pairwise_cosine`, from `found`:
    `loss` (B,), `g` per layer (B, n_k) and `G` per layer (n_k,) (float64)."""
    g, G = np.concatenate(found["g"], axis=1), np.concatenate(found["G"])
    batch = g.shape[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        norms = np.linalg.norm(g, axis=1)
        cosine = g @ G / (norms * np.linalg.norm(G))
        summed = g.sum(axis=0)
        mean = summed / batch
        trace = ((g - mean) ** 2).sum() / (batch - 1) if batch > 1 else np.nan
        return {
            "loss": found["loss"],
            "grad_norm": norms,
            "cosine": cosine,
            "layer_grad_norm": np.stack([np.linalg.norm(gk, axis=1) for gk in found["g"]], 1),
            "layer_cosine": np.stack(
                [
                    gk @ Gk / (np.linalg.norm(gk, axis=1) * np.linalg.norm(Gk))
                    for gk, Gk in zip(found["g"], found["G"])
                ],
                axis=1,
            ),
            "batch_grad_norm": np.linalg.norm(G),
            "gradient_diversity": (norms**2).sum() / (summed**2).sum(),
            "noise_scale": trace / (mean**2).sum(),
            "mean_cosine": np.nanmean(cosine),
            "frac_negative_cosine": np.mean(cosine < 0),
            "pairwise_cosine": g @ g.T / (norms[:, None] * norms[None, :]),
        }


def replayed_draws() -> Any:
    """`() -> None` that puts the global random state back as it is now: on PyTorch a
    Dropout without a seed of its own draws from torch's global generator (on JAX from
    its seed generator's state, which the model keeps)."""
    if keras.backend.backend() != "torch":
        return lambda: None
    import torch

    state = torch.random.get_rng_state()
    return lambda: torch.random.set_rng_state(state)


def tracked_statistics(
    model: Any, x: Any, y: Any, sample_weight: Any = None, names: Any = None
) -> dict[str, Any]:
    """The statistics of one tracked `fit` step on the whole batch (`names`, default: the
    default statistics)."""
    from keras_gradtrack import statistics

    reports: list[Any] = []
    model.gradient_tracking.subscribe("test", statistics.resolve(names), 1, reports.append)
    batch = len(keras.tree.flatten(x)[0])
    model.fit(x, y, sample_weight=sample_weight, batch_size=batch, shuffle=False, verbose=0)
    (report,) = reports
    assert report.values is not None
    return dict(report.values)


def assert_trains_as_plain(
    tracked: Any, plain: Any, x: Any, y: Any, batch_size: int
) -> dict[str, Any]:
    """Two steps of `fit` (the first tracked, the second not) give the plain model's
    weights and logs (`plain` starts from `tracked`'s weights); returns the tracked
    fit's history."""
    from keras_gradtrack import statistics

    tracked(x[:1]), plain(x[:1])
    plain.set_weights(tracked.get_weights())
    reports: list[Any] = []
    tracked.gradient_tracking.subscribe("test", statistics.resolve(None), 2, reports.append)
    replay = replayed_draws()  # the same dropout masks on both
    history = tracked.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0).history
    replay()
    expected = plain.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0).history
    assert [r.values is not None for r in reports] == [True, False]
    unseen = unseen_by_the_loss(tracked)
    steps = int(keras.ops.convert_to_numpy(tracked.optimizer.iterations))
    largest_steps = steps * float(keras.ops.convert_to_numpy(tracked.optimizer.learning_rate))
    for variable, got, want in zip(tracked.weights, tracked.get_weights(), plain.get_weights()):
        if id(variable) in unseen:
            # Its gradient is rounding errors, in another order than plain Keras' (as
            # Keras' own jitted and eager steps differ: 7e-5 on the transformer block
            # after two Adam steps): held to the optimizer's steps, not to equality.
            np.testing.assert_array_less(np.abs(got - want), largest_steps, err_msg=variable.path)
            continue
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=variable.path)
    assert history.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)
    return history

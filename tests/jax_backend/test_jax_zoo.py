"""The model zoo (`tests/zoo_models.py`: keras-io and Keras guide patterns) on JAX.

The same builders as the TensorFlow zoo test (`tests/test_zoo.py`), on
`KERAS_BACKEND=jax`: every model's statistics for a batch, per layer too, equal the
JAX oracle's (`jax.grad` per example; the full-batch oracle where BatchNormalization
trains), with no layer on the fallback and none refused; and two steps of `fit`, the
first tracked, train as the same model's untracked steps (Keras' own JAX step) from
the same weights. The guide's `custom_train_step` model is left out: its
`train_step` is TensorFlow's (`tf.GradientTape`); a step of one's own on JAX is
`test_jax_own_train_step.py`'s.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras
import numpy as np
import pytest
from extended import with_extended
from jax_oracle import assert_matches_oracle, oracle_statistics
from zoo_models import ZOO, Zoo

from keras_gradtrack import statistics

# keras-io's text models declare int64 inputs, which JAX (without x64) truncates to int32,
# warning as it does in plain Keras.
pytestmark = pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")

# Its step is TensorFlow's own (`tf.GradientTape`), which JAX cannot run.
ON_JAX = sorted(set(ZOO) - {"custom_train_step"})
# Compiled by XLA at some 20 s and more here: `make test-all`'s.
EXTENDED = {"separable_residual_classifier", "transfer_learning"}


def weighted_losses(model: Any) -> Any:
    """The oracle's loss for a model compiled with a dict of losses (the ticket
    classifier: its loss weights written out), else None (the compiled loss)."""
    if not isinstance(model.loss, dict):
        return None
    weights = {"priority": 1.0, "department": 0.2}
    assert sorted(model.loss) == sorted(weights)

    def loss(y: Any, y_pred: Any, sample_weight: Any) -> Any:
        return sum(
            weights[name] * model.loss[name](y[name], y_pred[name], sample_weight)
            for name in weights
        )

    return loss


def built(name: str, seed: int = 5) -> Zoo:
    """The zoo model `name` without dropout (the oracle's one-example passes would draw
    other masks), its weights from `seed`."""
    builder = ZOO[name]
    kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(builder).parameters else {}
    keras.utils.set_random_seed(seed)
    return builder(**kwargs)


@pytest.mark.parametrize("name", with_extended(ON_JAX, EXTENDED))
def test_the_zoo_matches_the_jax_oracle(name: str) -> None:
    zoo = built(name)
    paths = [tracked.path for tracked in zoo.model.gradient_tracking_plan()]
    assert not [path for path in paths if not path.startswith("rule:")], paths
    stats = zoo.model.gradient_statistics(zoo.x, zoo.y, zoo.sample_weight)
    expected = oracle_statistics(
        zoo.model,
        zoo.x,
        zoo.y,
        zoo.sample_weight,
        full_batch=zoo.full_batch,
        loss=weighted_losses(zoo.model),
    )
    assert_matches_oracle(stats, expected)


@pytest.mark.parametrize("name", with_extended(ON_JAX, EXTENDED))
def test_a_tracked_zoo_step_trains_as_keras_does(name: str) -> None:
    # Two steps of two examples less than the batch each: the first tracked, the second
    # not, against the same model's two untracked steps (Keras' own JAX step).
    tracked, plain = built(name), built(name)
    batch = len(keras.tree.flatten(tracked.x)[0]) // 2
    reports: list[Any] = []
    tracked.model.gradient_tracking.subscribe("test", statistics.resolve(None), 2, reports.append)

    def fit(zoo: Zoo) -> dict[str, Any]:
        history = zoo.model.fit(
            zoo.x,
            zoo.y,
            sample_weight=zoo.sample_weight,
            batch_size=batch,
            shuffle=False,
            verbose=0,
        )
        return history.history

    found, expected = fit(tracked), fit(plain)
    assert [report.values is not None for report in reports] == [True, False]
    for got, want in zip(tracked.model.get_weights(), plain.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert found.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(found[key], expected[key], rtol=1e-5, err_msg=key)

"""A model's own `train_step` on JAX: `self.tracked_value_and_grad` in place of
`jax.value_and_grad` gives the oracle's statistics and trains as the same step with
`jax.value_and_grad`; a step that does not call it is refused, naming it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import h5py
import jax
import keras
import numpy as np
import pytest
from backend_oracle import assert_trains_as_plain, tracked_statistics
from jax_oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack import statistics

BATCH = 8
DOCS = Path(__file__).resolve().parents[2] / "docs" / "jax.md"
rng = np.random.default_rng(11)


def keras_step_class(base: type, tracked: bool) -> type:
    """Keras' own JAX `train_step`, written out, as a model of one's own writes it."""

    class KerasStep(base):  # type: ignore[misc, valid-type]
        def train_step(self, state: Any, data: Any) -> Any:
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            value_and_grad = self.tracked_value_and_grad if tracked else jax.value_and_grad
            grad_fn = value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (_, aux), grads = grad_fn(
                trainable,
                non_trainable,
                metrics_variables,
                x,
                y,
                sample_weight,
                training=True,
                optimizer_variables=optimizer_variables,
            )
            unscaled_loss, y_pred, non_trainable, metrics_variables = aux
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
            logs, metrics_variables = self.stateless_compute_metrics_logs(
                metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
            )
            return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

        def stateless_compute_metrics_logs(self, metrics_variables: Any, loss: Any, *args: Any):
            with keras.StatelessScope(
                state_mapping=list(zip(self.metrics_variables, metrics_variables))
            ) as scope:
                self._loss_tracker.update_state(loss, sample_weight=len(args[0]))
                logs = self.compute_metrics(*args)
            return logs, [scope.get_current_value(v) for v in self.metrics_variables]

    return KerasStep


def guide_step_class(base: type, tracked: bool) -> type:
    """The keras.io guide's model ("Customizing what happens in `fit()` with JAX"):
    its own loss object, loss tracker and metric, updated statelessly."""

    class GuideStep(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def compute_loss_and_updates(
            self, trainable: Any, non_trainable: Any, x: Any, y: Any, training: bool = False
        ) -> Any:
            y_pred, non_trainable = self.stateless_call(
                trainable, non_trainable, x, training=training
            )
            return self.loss_fn(y, y_pred), (y_pred, non_trainable)

        def train_step(self, state: Any, data: Any) -> Any:
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y = data
            value_and_grad = self.tracked_value_and_grad if tracked else jax.value_and_grad
            grad_fn = value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable)), grads = grad_fn(
                trainable, non_trainable, x, y, training=True
            )
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
            count = len(self.loss_tracker.variables)
            loss_variables = self.loss_tracker.stateless_update_state(
                metrics_variables[:count], loss
            )
            mae_variables = self.mae_metric.stateless_update_state(
                metrics_variables[count:], y, y_pred
            )
            logs = {
                "loss": self.loss_tracker.stateless_result(loss_variables),
                "mae": self.mae_metric.stateless_result(mae_variables),
            }
            state = (trainable, non_trainable, optimizer_variables, loss_variables + mae_variables)
            return logs, state

        @property
        def metrics(self) -> list[Any]:
            return [self.loss_tracker, self.mae_metric]

    return GuideStep


def keras_step_model(base: type, tracked: bool) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=keras.regularizers.l2(1e-2)
    )(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    model = keras_step_class(base, tracked)(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def guide_step_model(base: type, tracked: bool) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = guide_step_class(base, tracked)(inputs, keras.layers.Dense(2)(hidden))
    # The compiled loss is the oracle's; the step uses its own (the same) loss object.
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.MeanSquaredError())
    return model


def data(name: str, count: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(count, 6)).astype("float32")
    if name == "keras_step":
        return x, rng.integers(0, 3, count)
    return x, rng.normal(size=(count, 2)).astype("float32")


MODELS = {"keras_step": keras_step_model, "guide_step": guide_step_model}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_statistics_of_an_own_train_step_match_the_oracle(name: str) -> None:
    model = MODELS[name](kgt.GradientTrackingModel, tracked=True)
    x, y = data(name)
    model(x)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_without_jit_an_own_train_step_gives_the_same_statistics() -> None:
    x, y = data("guide_step")
    found = []
    for jit_compile in (True, False):
        keras.utils.set_random_seed(7)
        model = guide_step_model(kgt.GradientTrackingModel, tracked=True)
        model.compile(
            optimizer="sgd", loss=keras.losses.MeanSquaredError(), jit_compile=jit_compile
        )
        found.append(tracked_statistics(model, x, y))
    for name, value in found[0].items():
        np.testing.assert_allclose(found[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_sample_weights_reach_the_per_example_losses() -> None:
    model = keras_step_model(kgt.GradientTrackingModel, tracked=True)
    x, y = data("keras_step")
    weights = rng.uniform(0.5, 2.0, BATCH).astype("float32")
    model(x)
    expected = oracle_statistics(model, x, y, weights)
    assert_matches_oracle(tracked_statistics(model, x, y, weights), expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_own_train_step_trains_as_with_jax_value_and_grad(name: str) -> None:
    tracked = MODELS[name](kgt.GradientTrackingModel, tracked=True)
    plain = MODELS[name](keras.Model, tracked=False)
    assert_trains_as_plain(tracked, plain, *data(name, 2 * BATCH), BATCH)


def assert_tracked_fit_refused(model: Any, x: Any, y: Any, error: type, match: str) -> None:
    """A fit with a tracked first step raises `error` and leaves the weights as they were."""
    before = model.get_weights()
    model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, lambda r: None)
    with pytest.raises(error, match=match):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_an_own_train_step_with_jax_value_and_grad_is_refused_naming_what_to_call() -> None:
    model = keras_step_model(kgt.GradientTrackingModel, tracked=False)
    x, y = data("keras_step")
    model.fit(x, y, batch_size=BATCH, verbose=0)  # untracked: its own step runs
    assert_tracked_fit_refused(
        model, x, y, NotImplementedError, r"did not call `self\.tracked_value_and_grad"
    )


def documented_example() -> str:
    """The first code block of docs/jax.md's section on a model's own `train_step`."""
    section = DOCS.read_text().split("## A model's own `train_step`", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def test_the_documented_train_step_runs_and_is_exact(tmp_path: Path, monkeypatch: Any) -> None:
    x, y = data("guide_step", 2 * BATCH)
    namespace: dict[str, Any] = {"x": x, "y": y}
    monkeypatch.chdir(tmp_path)
    exec(compile(documented_example(), str(DOCS), "exec"), namespace)
    with h5py.File(os.path.join(tmp_path, "run.h5"), "r") as f:
        assert f["per_example/cosine"].shape == (2 * BATCH,)
    model = namespace["model"]
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError())  # the oracle's loss
    expected = oracle_statistics(model, x[:BATCH], y[:BATCH])
    assert_matches_oracle(tracked_statistics(model, x[:BATCH], y[:BATCH]), expected)


class Misused(kgt.GradientTrackingModel):
    """A step of its own calling `tracked_value_and_grad` as `how` says."""

    how = "twice"

    def train_step(self, state: Any, data: Any) -> Any:
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        loss_fn = keras.losses.MeanSquaredError()

        def loss_of(trainable: Any, x: Any) -> Any:
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            return loss_fn(y, y_pred)

        def head_only(trainable: Any, x: Any) -> Any:
            y_pred, _ = self.get_layer("head").stateless_call(trainable[2:], [], x)
            return loss_fn(y, y_pred)

        if self.how == "argnums":
            _, grads = self.tracked_value_and_grad(lambda x, t: loss_of(t, x), argnums=1)(
                x, trainable
            )
        elif self.how == "head_only":
            _, grads = self.tracked_value_and_grad(head_only)(trainable, x)
        else:
            self.tracked_value_and_grad(loss_of)(trainable, x)
            _, grads = self.tracked_value_and_grad(loss_of)(trainable, x)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("twice", "ran twice in one tracked step"),
        ("argnums", "with respect to its function's first argument.*argnums=1"),
        ("head_only", r"did not call the tracked layers \['hidden'\]"),
    ],
)
def test_a_misused_tracked_value_and_grad_is_refused_before_any_weight_changes(
    how: str, match: str
) -> None:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(6, name="hidden")(inputs)
    model = Misused(inputs, keras.layers.Dense(2, name="head")(hidden))
    model.how = how
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError())
    x, y = data("guide_step")
    model.fit(x, y, batch_size=BATCH, verbose=0)  # untracked: plain jax.value_and_grad
    before = model.get_weights()
    model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, lambda r: None)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def super_step_class(base: type) -> type:
    """A step of one's own around Keras' step: `super().train_step`, then a log of its own."""

    class SuperStep(base):  # type: ignore[misc, valid-type]
        def train_step(self, state: Any, data: Any) -> Any:
            logs, state = super().train_step(state, data)
            return {**logs, "twice_the_loss": 2 * logs["loss"]}, state

    return SuperStep


def super_step_model(base: type) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = super_step_class(base)(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_an_own_step_calling_super_train_step_is_exact_and_trains_as_keras() -> None:
    x, y = data("keras_step", 2 * BATCH)
    model = super_step_model(kgt.GradientTrackingModel)
    model(x[:1])
    expected = oracle_statistics(model, x[:BATCH], y[:BATCH])
    assert_matches_oracle(tracked_statistics(model, x[:BATCH], y[:BATCH]), expected)

    tracked = super_step_model(kgt.GradientTrackingModel)
    history = assert_trains_as_plain(tracked, super_step_model(keras.Model), x, y, BATCH)
    assert "twice_the_loss" in history


def test_super_train_step_and_tracked_value_and_grad_in_one_step_are_refused() -> None:
    class Both(kgt.GradientTrackingModel):
        def train_step(self, state: Any, data: Any) -> Any:
            grad_fn = self.tracked_value_and_grad(self.compute_loss_and_updates, has_aux=True)
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            arguments = (trainable, non_trainable, metrics_variables, x, y, sample_weight)
            grad_fn(*arguments, training=True, optimizer_variables=optimizer_variables)
            return super().train_step(state, data)

    inputs = keras.Input((6,))
    model = Both(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = data("keras_step")
    model(x[:1])
    assert_tracked_fit_refused(model, x, y, ValueError, r"`super\(\)\.train_step` ran after")


def test_an_own_step_after_the_mixin_is_kept_and_its_super_call_refused() -> None:
    """`class Tracked(GradientTrackingMixin, Base)`, `Base`'s step its own: untracked
    steps run it; a tracked step, whose statistics it cannot give (its `super()`
    reaches Keras' step past the mixin), is refused before any weight changes, never
    replaced by Keras' step."""

    class Base(keras.Model):
        def train_step(self, state: Any, data: Any) -> Any:
            logs, state = super().train_step(state, data)
            return {**logs, "own": 1.0}, state

    class Tracked(kgt.GradientTrackingMixin, Base):
        pass

    inputs = keras.Input((6,))
    model = Tracked(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = data("keras_step")
    assert "own" in model.fit(x, y, batch_size=BATCH, verbose=0).history
    assert_tracked_fit_refused(
        model, x, y, NotImplementedError, r"nor this mixin's `super\(\)\.train_step"
    )

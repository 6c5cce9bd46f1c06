"""A model's own `train_step` on PyTorch, written as the Keras guide writes it
("Customizing what happens in `fit()` with PyTorch"), with `self.tracked_backward(loss)`
where it calls `loss.backward()`: exact against the oracle, trains as the same step with
`loss.backward()`, private, and refused clearly where misused (weights untouched)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import torch
from backend_oracle import assert_trains_as_plain, tracked_statistics
from keras.src.backend.torch.trainer import TorchTrainer
from private_step_cases import (
    assert_one_step_without_noise_is_the_clipped_sum,
    batch,
    private_model,
)
from source_compare import normalized
from torch_oracle import assert_matches_oracle, input_grad_norms, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack import statistics

BATCH = 6
rng = np.random.default_rng(31)


def backward(model: Any, loss: Any, tracked: bool) -> None:
    if tracked:
        model.tracked_backward(loss)
    else:
        loss.backward()


def compute_loss_step_class(base: type, tracked: bool) -> type:
    """The guide's first model: the compiled loss through `self.compute_loss`, the
    compiled metrics updated by hand (sample weights passed on)."""

    class ComputeLossStep(base):  # type: ignore[misc, valid-type]
        def train_step(self, data: Any) -> Any:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
            backward(self, loss, tracked)
            trainable_weights = [v for v in self.trainable_weights]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return ComputeLossStep


def loss_fn_step_class(base: type, tracked: bool) -> type:
    """The guide's lower-level model: its own loss object, loss tracker and metric."""

    class LossFnStep(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data: Any) -> Any:
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
            backward(self, loss, tracked)
            trainable_weights = [v for v in self.trainable_weights]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self) -> list[Any]:
            return [self.loss_tracker, self.mae_metric]

    return LossFnStep


def super_step_class(base: type, tracked: bool) -> type:
    """A step of one's own that calls Keras' through `super().train_step(data)`."""

    class SuperStep(base):  # type: ignore[misc, valid-type]
        def train_step(self, data: Any) -> Any:
            return {**super().train_step(data), "own": 1.0}

    return SuperStep


def classifier(model_class: type) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=keras.regularizers.l2(1e-2)
    )(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    model = model_class(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def regressor(model_class: type) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = model_class(inputs, keras.layers.Dense(2)(hidden))
    # The compiled loss is the oracle's; the step uses its own (the same) loss object.
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.MeanSquaredError())
    return model


STEPS = {
    "compute_loss": (compute_loss_step_class, classifier),
    "loss_fn": (loss_fn_step_class, regressor),
    "super_train_step": (super_step_class, classifier),
}


def model_of(name: str, base: type, tracked: bool = True) -> Any:
    step_class, build = STEPS[name]
    return build(step_class(base, tracked))


def data(name: str, count: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(count, 6)).astype("float32")
    if STEPS[name][1] is classifier:
        return x, rng.integers(0, 3, count)
    return x, rng.normal(size=(count, 2)).astype("float32")


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_statistics_of_an_own_train_step_match_the_oracle(name: str) -> None:
    model = model_of(name, kgt.GradientTrackingModel)
    x, y = data(name)
    model(x)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_sample_weights_reach_the_per_example_losses() -> None:
    model = model_of("compute_loss", kgt.GradientTrackingModel)
    x, y = data("compute_loss")
    weights = rng.uniform(0.5, 2.0, BATCH).astype("float32")
    model(x)
    expected = oracle_statistics(model, x, y, weights)
    assert_matches_oracle(tracked_statistics(model, x, y, weights), expected)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_an_own_train_step_trains_as_with_loss_backward(name: str) -> None:
    tracked = model_of(name, kgt.GradientTrackingModel)
    plain = model_of(name, keras.Model, tracked=False)
    history = assert_trains_as_plain(tracked, plain, *data(name, 2 * BATCH), BATCH)
    if name == "super_train_step":
        assert history["own"] == [1.0]


def test_input_gradients_and_a_loss_scale_optimizer_in_an_own_step() -> None:
    """`tracked_backward` finds the loss scale where the step calls `scale_loss`."""

    class ScaledStep(kgt.GradientTrackingModel):
        def train_step(self, data: Any) -> Any:
            x, y = data
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.tracked_backward(self.optimizer.scale_loss(loss))
            weights = self.trainable_weights[:]
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in weights], weights)
            return {"loss": loss}

    inputs = keras.Input((6,))
    model = ScaledStep(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, "tanh")(inputs)))
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = data("compute_loss")
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    expected["input_grad_norm"] = input_grad_norms(model, x, y)
    names = ["loss", "grad_norm", "cosine", "batch_grad_norm", "input_grad_norm"]
    assert_matches_oracle(tracked_statistics(model, x, y, names=names), expected)


def assert_tracked_fit_refused(model: Any, x: Any, y: Any, error: type, match: str) -> None:
    """A fit with a tracked first step raises `error` and leaves the weights (the
    optimizer's too) as they were."""
    model(x[:1])
    model.optimizer.build(model.trainable_variables)
    before = [np.array(v.numpy()) for v in [*model.variables, *model.optimizer.variables]]
    model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, lambda r: None)
    with pytest.raises(error, match=match):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    after = [np.array(v.numpy()) for v in [*model.variables, *model.optimizer.variables]]
    for got, want in zip(after, before):
        np.testing.assert_array_equal(got, want)


def test_an_own_step_with_loss_backward_is_refused_naming_what_to_call() -> None:
    model = model_of("compute_loss", kgt.GradientTrackingModel, tracked=False)
    x, y = data("compute_loss")
    model.fit(x, y, batch_size=BATCH, verbose=0)  # untracked: its own step runs
    assert_tracked_fit_refused(
        model, x, y, NotImplementedError, r"did not call `self\.tracked_backward\(loss\)`"
    )


class Misused(kgt.GradientTrackingModel):
    """`tracked_backward` twice, or after `super().train_step`, in one step."""

    misuse = "twice"

    def train_step(self, data: Any) -> Any:
        if self.misuse == "after_super":
            super().train_step(data)
        x, y = data
        loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.tracked_backward(loss)
        if self.misuse == "twice":
            self.tracked_backward(loss)
        return {}


@pytest.mark.parametrize("misuse", ["twice", "after_super"])
def test_a_second_differentiation_in_one_step_is_refused(misuse: str) -> None:
    inputs = keras.Input((6,))
    model = Misused(inputs, keras.layers.Dense(3)(inputs))
    model.misuse = misuse
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, lambda r: None)
    with pytest.raises(ValueError, match="one differentiation of the loss"):
        model.fit(x, np.zeros((BATCH, 3), "float32"), batch_size=BATCH, verbose=0)


@pytest.mark.parametrize("name", ["compute_loss", "super_train_step"])
def test_an_own_train_step_receives_the_clipped_sum(name: str) -> None:
    model = private_model("mlp")
    step_class = STEPS[name][0](kgt.GradientTrackingModel, True)
    own = step_class(model.inputs, model.outputs)
    own.compile(optimizer=model.optimizer, loss=model.loss)
    assert_one_step_without_noise_is_the_clipped_sum(own, *batch("mlp"))
    assert own.private_steps == 1


def test_the_mixins_step_is_keras_own_but_for_tracked_backward() -> None:
    source = normalized(TorchTrainer.train_step)
    substitutions = [
        ("data_adapter_utils.unpack_x_y_sample_weight", "keras.utils.unpack_x_y_sample_weight"),
        ("tree.flatten(x)", "keras.tree.flatten(x)"),
        ("loss.backward()", "self.tracked_backward(loss)"),
        (
            "warnings.warn('The model does not have any trainable weights.')",
            "warnings.warn('The model does not have any trainable weights.', stacklevel=2)",
        ),
    ]
    for keras_says, mixin_says in substitutions:
        assert keras_says in source, f"Keras' torch train_step no longer says {keras_says}"
        source = source.replace(keras_says, mixin_says)
    ours = normalized(kgt.GradientTrackingMixin._keras_tracked_step)
    assert ours.replace("_keras_tracked_step", "train_step") == source


def test_the_documented_train_step_runs_and_is_exact() -> None:
    """The code block of docs/torch.md's section on a model's own `train_step`."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "torch.md"
    section = docs.read_text().split("## A model's own `train_step`", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    namespace: dict[str, Any] = {"kgt": kgt, "keras": keras, "torch": torch}
    exec(compile(match.group(1), str(docs), "exec"), namespace)
    model = classifier(namespace["CustomModel"])
    x, y = data("compute_loss")
    model(x)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)

"""Property tests: every statistic equals the per-example-tape oracle on random models.

Hypothesis draws a small layer stack (Dense of random widths and activations, on flat
or sequence inputs, Conv1D, LayerNormalization), a batch size from 1 to 9, a loss and
its reduction, and sample weights (none, random, some or all zero), then compares
`model.gradient_statistics` with `tests/oracle.py`. The search is derandomized, so
every run tries the same examples: the suite stays deterministic and quick (building
Keras models is what costs).

Batch size 1 has no noise scale (its variance estimate divides by B - 1): the oracle
gives NaN; the model's value is checked on its own, in an expected failure, until it
gives NaN too.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

ACTIVATIONS = ["linear", "relu", "tanh", "sigmoid", "elu"]
REDUCTIONS = ["sum_over_batch_size", "sum"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn model, batch and loss; `build` makes the compiled model and data."""

    sequence_length: int | None  # None: flat inputs (B, features)
    features: int
    layers: tuple[tuple[str, int, str], ...]  # (kind, width, activation)
    classification: bool
    outputs: int
    reduction: str
    batch_size: int
    weights: str  # "none", "random", "some_zero", "all_zero"
    seed: int

    def build(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray | None]:
        rng = np.random.default_rng(self.seed)
        shape = (
            (self.features,)
            if self.sequence_length is None
            else (
                self.sequence_length,
                self.features,
            )
        )
        inputs = keras.Input(shape)
        hidden = inputs
        for kind, width, activation in self.layers:
            if kind == "dense":
                hidden = keras.layers.Dense(width, activation=activation)(hidden)
            elif kind == "conv1d":
                hidden = keras.layers.Conv1D(width, 2, padding="same", activation=activation)(
                    hidden
                )
            else:
                hidden = keras.layers.LayerNormalization()(hidden)
        if self.sequence_length is not None:
            hidden = keras.layers.Flatten()(hidden)
        outputs = keras.layers.Dense(self.outputs)(hidden)
        model = kgt.GradientTrackingModel(inputs, outputs)
        if self.classification:
            loss: Any = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=self.reduction
            )
            y = rng.integers(0, self.outputs, self.batch_size)
        else:
            loss = keras.losses.MeanSquaredError(reduction=self.reduction)
            y = rng.normal(size=(self.batch_size, self.outputs))
        model.compile(optimizer="sgd", loss=loss)
        x = rng.normal(size=(self.batch_size, *shape))
        sample_weight = {
            "none": None,
            "random": rng.uniform(0.1, 2.0, self.batch_size),
            "some_zero": rng.uniform(0.1, 2.0, self.batch_size)
            * (rng.random(self.batch_size) < 0.6),
            "all_zero": np.zeros(self.batch_size),
        }[self.weights]
        return model, x, y, sample_weight


@st.composite
def layer_stacks(draw: st.DrawFn, sequence: bool) -> tuple[tuple[str, int, str], ...]:
    kinds = ["dense", "conv1d"] if sequence else ["dense"]
    stack = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(kinds))
        # LayerNormalization of one feature is constant: keep two or more.
        width = draw(st.integers(1, 5))
        stack.append((kind, width, draw(st.sampled_from(ACTIVATIONS))))
        if width > 1 and draw(st.booleans()):
            stack.append(("layer_norm", width, "linear"))
    return tuple(stack)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    sequence = draw(st.booleans())
    classification = draw(st.booleans())
    return Case(
        sequence_length=draw(st.integers(2, 4)) if sequence else None,
        features=draw(st.integers(1, 4)),
        layers=draw(layer_stacks(sequence)),
        classification=classification,
        outputs=draw(st.integers(2, 3) if classification else st.integers(1, 3)),
        reduction=draw(st.sampled_from(REDUCTIONS)),
        batch_size=draw(st.integers(1, 9)),
        weights=draw(st.sampled_from(["none", "random", "some_zero", "all_zero"])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases())
def test_statistics_match_the_oracle_on_random_models(case: Case) -> None:
    model, x, y, sample_weight = case.build()
    with warnings.catch_warnings():
        # Zero weights make every cosine NaN, and so their mean: numpy says so aloud.
        warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
        expected = oracle_statistics(model, x, y, sample_weight)
    stats = model.gradient_statistics(x, y, sample_weight)
    assert stats["layer_grad_norm"].shape == (case.batch_size, len(model.tracked_layer_names))
    assert_matches_oracle(stats, expected)


def test_noise_scale_of_a_batch_of_one_is_nan() -> None:
    # Found by the property test above (Dense(1) on one feature, mse, batch of one).
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    found = []
    for _ in range(12):
        x, y = rng.normal(size=(1, 3)), rng.normal(size=(1, 2))
        assert np.isnan(oracle_statistics(model, x, y)["noise_scale"])
        found.append(float(model.gradient_statistics(x, y)["noise_scale"]))
    assert np.isnan(found).all(), found

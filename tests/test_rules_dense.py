"""Dense on 2-D inputs: dots taken directly or from the Gram matrix, both exact.

Where the batch gradient is the sum of the per-example gradients (one replica,
no regularizer), `<g_i, G> = sum_j <g_i, g_j>`; the rule takes that form when it
costs less for the batch size (decided at run time when the batch size is not
static). Each case asserts which form ran, so a broken choice cannot hide
behind the other form's correct numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.rules import dense as dense_rule

rng = np.random.default_rng(5)


def wide_mlp(width: int, regularizer: Any = None) -> Any:
    inputs = keras.Input((width,))
    hidden = keras.layers.Dense(width, activation="tanh", kernel_regularizer=regularizer)(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.fixture
def gram_traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the traces of the Gram form (a spy: the real function still runs)."""
    traces: list[int] = []
    original = dense_rule.dense_2d_gram

    def spy(*args: Any) -> Any:
        traces.append(1)
        return original(*args)

    monkeypatch.setattr(dense_rule, "dense_2d_gram", spy)
    return traces


@pytest.mark.parametrize(
    ("batch", "width", "regularized", "gram"),
    [
        (4, 48, False, True),  # 4 * 96 < 48 * 48: the Gram form
        (64, 6, False, False),  # 64 * 12 > 36: directly
        (4, 48, True, False),  # the batch gradient includes the penalty: directly
    ],
    ids=["gram", "direct", "regularized"],
)
def test_static_batch_uses_the_cheaper_form_and_matches_the_oracle(
    gram_traces: list[int], batch: int, width: int, regularized: bool, gram: bool
) -> None:
    model = wide_mlp(width, keras.regularizers.L2(0.1) if regularized else None)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.integers(0, 3, batch)
    stats = model.gradient_statistics(x, y)
    assert bool(gram_traces) == gram
    assert_matches_oracle(stats, oracle_statistics(model, x, y))


def test_unknown_batch_size_chooses_at_run_time_and_matches_the_oracle(
    gram_traces: list[int], tmp_path: Path
) -> None:
    """`fit` on 20 examples in batches of 16 and 4 (width 24): the first step is
    cheaper directly (16 * 48 > 576), the second from the Gram matrix (4 * 48 < 576)."""
    model = wide_mlp(24)
    x = rng.normal(size=(20, 24)).astype("float32")
    y = rng.integers(0, 3, 20)
    weights = rng.uniform(0.5, 2.0, 20).astype("float32")
    expected = []

    class Oracle(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rows = slice(batch * 16, batch * 16 + 16)
            expected.append(oracle_statistics(model, x[rows], y[rows], weights[rows]))

    model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=16,
        shuffle=False,
        verbose=0,
        callbacks=[Oracle(), kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    assert gram_traces  # traced inside the run-time choice
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        steps = log.per_example("step")
        for step, oracle in enumerate(expected):
            logged = {name: log.per_example(name)[steps == step] for name in log.per_example_names}
            logged.update({name: log.per_step(name)[step] for name in log.per_step_names})
            assert_matches_oracle(logged, oracle)

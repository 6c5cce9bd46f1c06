"""The model zoo (`zoo_models.py`: keras-io and Keras guide patterns) against the oracle.

Every model: one batch's statistics, per layer too, equal the oracle's; no layer
is on the fallback path and none is refused, which `kgt.check` says before any
step, with the forms the step then takes; one tracked step trains as one plain
Keras step (`invariant.py`). Several also train with `fit` and an
`HDF5GradientLogger`, each logged step compared with the oracle at the weights
before that step's update (ragged last batch included).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from extended import with_extended
from invariant import assert_tracked_step_equals_plain
from keras import tree
from oracle import assert_matches_oracle, oracle_statistics
from zoo_models import ZOO, Zoo, transfer_learning

import keras_gradtrack as kgt


def without_dropout(name: str, **kwargs: Any) -> Zoo:
    """The zoo model `name` with dropout off: the oracle's one-example forward
    passes would draw other masks than the batch."""
    builder = ZOO[name]
    if "dropout" in inspect.signature(builder).parameters:
        kwargs["dropout"] = 0.0
    return builder(**kwargs)


def rows(data: Any, selected: slice) -> Any:
    return tree.map_structure(lambda a: None if a is None else a[selected], data)


@pytest.mark.parametrize(
    "name",
    # keras-io's IMDB Bidirectional LSTM is test_recurrent.py's too
    # (test_keras_io_bidirectional_lstm_imdb_pattern): here `make test-all`'s.
    with_extended(sorted(ZOO), {"bidirectional_lstm"}),
)
def test_known_before_training_and_exact_for_a_batch(name: str) -> None:
    zoo = without_dropout(name)
    report = kgt.check(zoo.model)
    assert report.refusals == []
    assert report.fallback_layers == []
    summary = zoo.model.gradient_tracking_summary(print_fn=lambda _: None)
    assert f"{len(report.layers)} tracked layers, 0 on the fallback path, 0 refused" in summary

    # Sequences of any length (the text models' inputs): the forms for these shapes.
    predicted = {row.name: row.form for row in kgt.check(zoo.model, x=zoo.x).layers}
    stats = zoo.model.gradient_statistics(zoo.x, zoo.y, zoo.sample_weight)
    expected = oracle_statistics(
        zoo.model, zoo.x, zoo.y, zoo.sample_weight, full_batch=zoo.full_batch
    )
    assert_matches_oracle(stats, expected)
    assert predicted == zoo.model.gradient_tracking.forms


@pytest.mark.parametrize(
    "name",
    # Compiled by XLA (`jit_compile=True`), some 15 s here: `make test-all`'s (its
    # statistics are held to the oracle above; a compiled tracked fit, in
    # test_rules_conv.py and test_fit.py).
    with_extended(sorted(ZOO), {"separable_residual_classifier"}),
)
def test_a_tracked_step_trains_as_plain_keras(name: str) -> None:
    """With the examples' own dropout: the same random draws on both steps."""
    zoo = ZOO[name]()
    assert_tracked_step_equals_plain(zoo.model, zoo.x, zoo.y, zoo.sample_weight)


@pytest.mark.parametrize(
    ("name", "examples"),
    [
        ("transformer_classifier", 10),
        ("ticket_classifier", 10),
        ("custom_train_step", 10),
        # XLA compiles once per batch shape, at 20 to 60 s here: one shape only, and
        # only in make test-all (a compiled fit is checked against the oracle in
        # test_rules_conv.py and test_fit.py by default).
        pytest.param(
            "separable_residual_classifier", 8, marks=[pytest.mark.slow, pytest.mark.extended]
        ),
    ],
)
def test_fit_logs_every_step_as_the_oracle_computes_it(
    tmp_path: Path, name: str, examples: int
) -> None:
    """Through `fit` with each example's own optimizer (and, for the residual
    classifier, `jit_compile=True`; for the custom model, its own `train_step`)."""
    zoo = without_dropout(name, batch=examples)
    model, batch_size = zoo.model, 4
    expected = []

    class Oracle(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            selected = slice(batch * batch_size, (batch + 1) * batch_size)
            expected.append(oracle_statistics(model, rows(zoo.x, selected), rows(zoo.y, selected)))

    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(
        zoo.x,
        zoo.y,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Oracle(), logger],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.per_step("batch_size").tolist() == [4, 4, 2][: len(expected)]
        assert len(expected) == -(-examples // batch_size)
        steps = log.per_example("step")
        for step, oracle in enumerate(expected):
            selected = steps == step
            logged = {name: log.per_example(name)[selected] for name in log.per_example_names}
            logged.update({name: log.per_step(name)[step] for name in log.per_step_names})
            assert_matches_oracle(logged, oracle)


@pytest.mark.parametrize("name", ["mnist_convnet", "transformer_classifier"])
def test_with_the_examples_dropout_the_rows_sum_to_the_batch_gradient(
    tmp_path: Path, name: str
) -> None:
    """With dropout on, no one-example oracle draws the batch's masks; but the
    per-example gradients of a mean loss still average to the batch gradient G:
    `mean_i ||g_i|| cos(g_i, G) = <mean_i g_i, G> / ||G|| = ||G||`."""
    zoo = ZOO[name](batch=12)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    zoo.model.fit(zoo.x, zoo.y, batch_size=6, epochs=1, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        steps = log.per_example("step")
        projected = log.per_example("grad_norm") * log.per_example("cosine")
        for step in range(2):
            np.testing.assert_allclose(
                projected[steps == step].mean(), log.per_step("batch_grad_norm")[step], rtol=1e-4
            )


def test_unfreezing_the_base_shows_its_batch_normalization_refused_before_training() -> None:
    """The guide's fine-tuning stage (`base_model.trainable = True`) trains the base's
    BatchNormalization layers too: `kgt.check` lists each as refused, with why."""
    zoo = transfer_learning(dropout=0.0)
    base = zoo.model.get_layer("mobilenetv2_0.35_32")
    base.trainable = True
    report = kgt.check(zoo.model)
    refused = [row for row in report.layers if row.path == "refused"]
    batch_norms = [
        layer.name
        for layer in base._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    assert [row.name for row in refused] == batch_norms
    assert all("in training mode" in row.refusal for row in refused)
    assert report.fallback_layers == []
    assert {row.path for row in report.layers} - {"refused"} == {
        "rule:conv",
        "rule:depthwise_conv",
        "rule:dense",
    }
    with pytest.raises(ValueError, match="is a BatchNormalization in training mode"):
        zoo.model.gradient_statistics(zoo.x, zoo.y)

"""keras.applications: transfer learning and fine-tuning, every layer on a rule, exact.

Small inputs (32 x 32), three classes, no downloaded weights (`weights=None`), a
few examples. The scenarios are those of the Keras guides: a frozen base with a
new head; the top layers fine-tuned with BatchNormalization frozen; the top
layers fine-tuned with BatchNormalization training (opt-in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from extended import with_extended
from invariant import assert_tracked_step_equals_plain
from keras.src.applications.convnext import LayerScale
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

pytestmark = pytest.mark.slow

applications = keras.applications
layers = keras.layers
SHAPE = (32, 32, 3)
FAMILIES: dict[str, Callable[[], Any]] = {
    "MobileNetV2": lambda: applications.MobileNetV2(
        input_shape=SHAPE, alpha=0.35, include_top=False, weights=None
    ),
    "EfficientNetB0": lambda: applications.EfficientNetB0(
        input_shape=SHAPE, include_top=False, weights=None
    ),
    "ResNet50V2": lambda: applications.ResNet50V2(
        input_shape=SHAPE, include_top=False, weights=None
    ),
    "DenseNet121": lambda: applications.DenseNet121(
        input_shape=SHAPE, include_top=False, weights=None
    ),
    "ConvNeXtTiny": lambda: applications.ConvNeXtTiny(
        input_shape=SHAPE, include_top=False, weights=None
    ),
}
rng = np.random.default_rng(5)
# Two examples: every forward of the oracle runs the whole network eagerly.
X = rng.normal(size=(2, *SHAPE)).astype("float32")
Y = np.array([0, 2])


def base_model(family: str) -> Any:
    base = FAMILIES[family]()
    for layer in base._flatten_layers():
        # Random masks would differ between the step and the oracle's forward.
        if isinstance(layer, layers.Dropout):
            layer.rate = 0.0
    return base


def classifier(base: Any, top_batch_normalization: bool = False) -> Any:
    inputs = keras.Input(SHAPE)
    hidden = layers.GlobalAveragePooling2D(name="avg_pool")(base(inputs))
    if top_batch_normalization:
        # The head of the Keras EfficientNet fine-tuning example.
        hidden = layers.BatchNormalization(name="top_bn")(hidden)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3, name="predictions")(hidden))
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def fine_tune_top(base: Any, count: int, batch_normalization: bool) -> None:
    """Trains the last `count` layers of `base`; its BatchNormalization only if asked."""
    base.trainable = True
    for layer in base.layers[:-count]:
        layer.trainable = False
    for layer in base.layers[-count:]:
        if isinstance(layer, layers.BatchNormalization):
            layer.trainable = batch_normalization


def matches_oracle(model: Any, full_batch: bool = False) -> None:
    """Exact against the oracle, and one tracked step equal to one plain Keras step."""
    state = [(v, v.numpy()) for v in model.non_trainable_variables]
    stats = model.gradient_statistics(X, Y)
    for variable, value in state:
        variable.assign(value)
    assert_matches_oracle(stats, oracle_statistics(model, X, Y, full_batch=full_batch))
    for variable, value in state:
        variable.assign(value)
    assert_tracked_step_equals_plain(model, X, Y)


# DenseNet121 (17 s under load) has no layer type the other families lack.
@pytest.mark.parametrize(
    "family",
    with_extended(FAMILIES, {"DenseNet121"}),
)
def test_every_trainable_layer_has_a_rule(family: str) -> None:
    base = base_model(family)
    model = classifier(base)
    model.track_batch_normalization = True
    fallback = [tracked.name for tracked in model.gradient_tracking_plan() if tracked.rule is None]
    assert fallback == []
    assert "0 on the fallback path" in model.gradient_tracking_summary(print_fn=lambda _: None)


# 42 s under load: its one tracked layer is a Dense head over a frozen base, as the
# zoo's transfer_learning model (MobileNetV2) checks in the default run.
@pytest.mark.extended
def test_transfer_learning_with_a_frozen_base() -> None:
    base = base_model("DenseNet121")
    base.trainable = False
    model = classifier(base)
    matches_oracle(model)
    assert model.tracked_layer_names == ["predictions"]


def test_fine_tuning_the_top_layers_with_batch_normalization_frozen() -> None:
    base = base_model("ResNet50V2")
    fine_tune_top(base, 8, batch_normalization=False)
    model = classifier(base)
    matches_oracle(model)
    assert model.tracked_layer_names == [
        "conv5_block3_2_conv",
        "conv5_block3_3_conv",
        "predictions",
    ]


def test_efficientnet_fine_tuning_example_trains_its_top_batch_normalization() -> None:
    base = base_model("EfficientNetB0")
    base.trainable = False
    model = classifier(base, top_batch_normalization=True)
    model.track_batch_normalization = True
    matches_oracle(model, full_batch=True)
    # Nothing before the top BatchNormalization trains: no coupled layer, only rules.
    assert model.gradient_tracking.forms == {"top_bn": "materialized", "predictions": "direct"}


# Batch normalization training in a fine-tuned top is the EfficientNet example's above:
# this deeper case is `make test-all`'s.
@pytest.mark.extended
def test_fine_tuning_the_top_layers_with_batch_normalization_training() -> None:
    base = base_model("MobileNetV2")
    fine_tune_top(base, 12, batch_normalization=True)
    model = classifier(base)
    model.track_batch_normalization = True
    matches_oracle(model, full_batch=True)
    forms = model.gradient_tracking.forms
    assert forms["block_16_project"] == "coupled"
    assert forms["Conv_1_bn"] == "materialized" and forms["predictions"] == "direct"


def test_convnext_block_with_layer_scale() -> None:
    """ConvNeXt's block (grouped 7x7 convolution, LayerNormalization, pointwise Dense,
    LayerScale) on a small input; the whole ConvNeXtTiny runs its grouped convolutions
    through XLA, compiled anew on every eager call of the oracle."""
    inputs = keras.Input((8, 8, 16))
    hidden = layers.Conv2D(16, 7, padding="same", groups=16, name="depthwise_conv")(inputs)
    hidden = layers.LayerNormalization(epsilon=1e-6, name="layernorm")(hidden)
    hidden = layers.Dense(64, activation="gelu", name="pointwise_conv_1")(hidden)
    hidden = layers.Dense(16, name="pointwise_conv_2")(hidden)
    hidden = LayerScale(1e-6 + 0.5, 16, name="layer_scale")(hidden)
    outputs = layers.Dense(3, name="predictions")(
        layers.GlobalAveragePooling2D()(layers.Add()([inputs, hidden]))
    )
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x = rng.normal(size=(4, 8, 8, 16)).astype("float32")
    y = np.array([0, 1, 2, 1])
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))
    assert model.gradient_tracking.forms["layer_scale"] == "materialized"
    assert_tracked_step_equals_plain(model, x, y)

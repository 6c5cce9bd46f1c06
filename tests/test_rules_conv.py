"""The convolution rules against the per-example oracle.

Every case also asserts that the plan reports the rule for the layers under
test, so a rule that silently stops applying (and leaves the work to the
fallback) fails here rather than only getting slower. Each case requests every
built-in statistic plus `pairwise_cosine`, which checks the rules' Gram matrices.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.engine.tracked_layer import FALLBACK_PATH
from keras_gradtrack.rule_math import gram_has_fewer_products
from keras_gradtrack.rules import LayerCall, chunks, filter_gradients, lookup
from keras_gradtrack.rules.filter_gradients import grouped_filter_gradient_runs
from keras_gradtrack.rules.windows import FEW_CHANNELS, Window
from keras_gradtrack.statistics import DEFAULT_STATISTICS

rng = np.random.default_rng(5)
BATCH = 4
STATISTICS = [*DEFAULT_STATISTICS, "pairwise_cosine"]
L = keras.layers

# model, x, y, expected path per layer class
Case = tuple[keras.Model, Any, Any, dict[type, str]]

RULE_NAMES = {
    L.Conv1D: "conv",
    L.Conv2D: "conv",
    L.Conv3D: "conv",
    L.DepthwiseConv1D: "depthwise_conv",
    L.DepthwiseConv2D: "depthwise_conv",
    L.SeparableConv1D: "separable_conv",
    L.SeparableConv2D: "separable_conv",
    L.Conv1DTranspose: "conv_transpose",
    L.Conv2DTranspose: "conv_transpose",
    L.Conv3DTranspose: "conv_transpose",
}


def classifier(inputs: Any, hidden: Any, classes: int = 3) -> keras.Model:
    if len(hidden.shape) > 2:
        hidden = L.Flatten()(hidden)
    outputs = L.Dense(classes)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def single_layer(
    name: str, make_layer: Callable[[], keras.layers.Layer], input_shape: tuple[int, ...]
) -> Any:
    """A case: the layer on `input_shape`, then Flatten and a Dense classifier."""

    def build() -> Case:
        inputs = keras.Input(input_shape)
        layer = make_layer()
        model = classifier(inputs, layer(inputs))
        x = rng.normal(size=(BATCH, *input_shape))
        path = f"rule:{RULE_NAMES[type(layer)]}"
        return model, x, rng.integers(0, 3, BATCH), {type(layer): path}

    return pytest.param(build, id=name)


def gram_form(name: str, groups: int) -> Any:
    """Few output positions, wide windows: the Gram form is cheaper than materializing."""
    # 2 x 2 output positions, 3 x 3 x 16 / groups wide windows, 32 / groups filters per group.
    assert gram_has_fewer_products(4, 9 * 16 // groups, 32 // groups)
    return single_layer(name, lambda: L.Conv2D(32, 3, groups=groups, activation="tanh"), (4, 4, 16))


def shared_conv(channels: int) -> Any:
    """One Conv2D called on two inputs of different sizes: per-example gradients add up."""

    def build() -> Case:
        small, large = keras.Input((5, 5, channels)), keras.Input((7, 6, channels))
        shared = L.Conv2D(3, 2, strides=2, padding="same", activation="relu")
        pooled = [L.GlobalAveragePooling2D()(shared(inputs)) for inputs in (small, large)]
        model = classifier([small, large], L.Concatenate()(pooled))
        x = [rng.normal(size=(BATCH, 5, 5, channels)), rng.normal(size=(BATCH, 7, 6, channels))]
        return model, x, rng.integers(0, 3, BATCH), {L.Conv2D: "rule:conv"}

    return pytest.param(build, id=f"shared_conv_{channels}_channels")


def shared_gram_conv() -> Case:
    """A shared Conv2D in the Gram form: both calls' windows stacked along the positions."""
    # 2 x 2 + 3 x 2 output positions, 3 x 3 x 16 wide windows, 32 filters.
    assert gram_has_fewer_products(10, 9 * 16, 32)
    small, large = keras.Input((4, 4, 16)), keras.Input((5, 4, 16))
    shared = L.Conv2D(32, 3, activation="tanh")
    pooled = [L.GlobalAveragePooling2D()(shared(inputs)) for inputs in (small, large)]
    model = classifier([small, large], L.Concatenate()(pooled))
    x = [rng.normal(size=(BATCH, 4, 4, 16)), rng.normal(size=(BATCH, 5, 4, 16))]
    return model, x, rng.integers(0, 3, BATCH), {L.Conv2D: "rule:conv"}


def shared_separable_and_transpose() -> Case:
    inputs = keras.Input((6, 3))
    separable = L.SeparableConv1D(3, 3, padding="same", depth_multiplier=2)
    upsample = L.Conv1DTranspose(3, 2, strides=2)
    hidden = upsample(separable(separable(inputs)))
    hidden = upsample(L.MaxPooling1D(2)(hidden))
    paths = {L.SeparableConv1D: "rule:separable_conv", L.Conv1DTranspose: "rule:conv_transpose"}
    return (
        classifier(inputs, hidden),
        rng.normal(size=(BATCH, 6, 3)),
        rng.integers(0, 3, BATCH),
        paths,
    )


def small_cnn() -> Case:
    """Two convolutions and a Dense layer on 28x28x1 images, batch 8."""
    inputs = keras.Input((28, 28, 1))
    hidden = L.Conv2D(4, 3, activation="relu")(inputs)
    hidden = L.MaxPooling2D(2)(hidden)
    hidden = L.Conv2D(6, 3, strides=2, activation="relu")(hidden)
    model = classifier(inputs, hidden, classes=10)
    x = rng.uniform(size=(8, 28, 28, 1))
    return model, x, rng.integers(0, 10, 8), {L.Conv2D: "rule:conv"}


def frozen_kernels() -> Case:
    """Only the trainable variables of a layer enter its gradient."""
    inputs = keras.Input((7, 7, 2))
    separable = L.SeparableConv2D(3, 3, depth_multiplier=2)
    conv = L.Conv2D(3, 2)
    hidden = conv(separable(inputs))
    separable.depthwise_kernel.trainable = False
    conv.kernel.trainable = False
    paths = {L.SeparableConv2D: "rule:separable_conv", L.Conv2D: "rule:conv"}
    return (
        classifier(inputs, hidden),
        rng.normal(size=(BATCH, 7, 7, 2)),
        rng.integers(0, 3, BATCH),
        paths,
    )


CASES = [
    single_layer("conv1d_relu", lambda: L.Conv1D(4, 3, activation="relu"), (9, 2)),
    # More channels than FEW_CHANNELS (8 inputs; 6 output-gradient channels under the
    # transposed windows): one product per kernel offset (the others: one product).
    single_layer("conv2d_many_channels", lambda: L.Conv2D(5, 3, padding="same"), (6, 6, 8)),
    single_layer(
        "conv1d_transpose_many_filters", lambda: L.Conv1DTranspose(6, 3, strides=2), (5, 3)
    ),
    single_layer(
        "conv1d_causal_dilated",
        lambda: L.Conv1D(3, 3, padding="causal", dilation_rate=2, use_bias=False),
        (9, 2),
    ),
    single_layer(
        "conv1d_causal_strided_groups",
        lambda: L.Conv1D(6, 4, strides=2, padding="causal", groups=2),
        (10, 4),
    ),
    single_layer(
        "conv1d_same_strided_groups",
        lambda: L.Conv1D(6, 4, strides=3, padding="same", groups=2),
        (11, 4),
    ),
    single_layer(
        "conv2d_same_strided",
        lambda: L.Conv2D(4, (3, 2), strides=(2, 1), padding="same"),
        (7, 6, 3),
    ),
    single_layer(
        "conv2d_dilated_groups",
        lambda: L.Conv2D(6, 3, padding="same", dilation_rate=2, groups=3),
        (6, 7, 3),
    ),
    single_layer(
        "conv2d_channels_first_groups",
        lambda: L.Conv2D(4, 2, groups=2, data_format="channels_first"),
        (2, 5, 4),
    ),
    gram_form("conv2d_gram_form", groups=1),
    gram_form("conv2d_gram_form_groups", groups=2),
    single_layer(
        "conv3d_same_strided",
        lambda: L.Conv3D(3, 2, strides=2, padding="same", activation="elu"),
        (5, 4, 3, 2),
    ),
    single_layer(
        "conv3d_dilated_groups",
        lambda: L.Conv3D(4, (2, 3, 2), dilation_rate=2, groups=2, use_bias=False),
        (5, 6, 5, 2),
    ),
    single_layer(
        "conv3d_channels_first",
        lambda: L.Conv3D(2, 2, padding="same", data_format="channels_first"),
        (2, 3, 4, 3),
    ),
    single_layer(
        "depthwise1d_strided_dilated",
        lambda: L.DepthwiseConv1D(
            3, strides=2, dilation_rate=2, padding="same", depth_multiplier=2
        ),
        (11, 3),
    ),
    single_layer(
        "depthwise2d_valid_no_bias",
        lambda: L.DepthwiseConv2D((3, 2), use_bias=False, activation="relu"),
        (6, 5, 3),
    ),
    single_layer(
        "depthwise2d_channels_first",
        lambda: L.DepthwiseConv2D(2, strides=2, depth_multiplier=2, data_format="channels_first"),
        (3, 6, 5),
    ),
    single_layer(
        "separable1d_strided_dilated",
        lambda: L.SeparableConv1D(
            4, 3, strides=2, dilation_rate=2, padding="same", depth_multiplier=2
        ),
        (11, 3),
    ),
    single_layer(
        "separable2d_same",
        lambda: L.SeparableConv2D(4, 3, padding="same", depth_multiplier=2, activation="relu"),
        (6, 5, 3),
    ),
    single_layer(
        "separable2d_channels_first_no_bias",
        lambda: L.SeparableConv2D(3, 2, strides=2, use_bias=False, data_format="channels_first"),
        (2, 6, 6),
    ),
    single_layer(
        "conv1d_transpose_strided",
        lambda: L.Conv1DTranspose(4, 3, strides=2, activation="tanh"),
        (5, 3),
    ),
    single_layer(
        "conv1d_transpose_same_output_padding",
        lambda: L.Conv1DTranspose(3, 4, strides=3, padding="same", output_padding=1),
        (4, 2),
    ),
    single_layer(
        "conv2d_transpose_same",
        lambda: L.Conv2DTranspose(3, 3, strides=2, padding="same"),
        (4, 3, 2),
    ),
    single_layer(
        "conv2d_transpose_output_padding",
        lambda: L.Conv2DTranspose(3, (3, 2), strides=2, output_padding=1, use_bias=False),
        (3, 4, 2),
    ),
    single_layer(
        "conv3d_transpose_same",
        lambda: L.Conv3DTranspose(2, 2, strides=(2, 1, 2), padding="same"),
        (3, 2, 3, 2),
    ),
    shared_conv(2),
    shared_conv(6),
    pytest.param(shared_gram_conv, id="shared_gram_conv"),
    pytest.param(shared_separable_and_transpose, id="shared_separable_and_transpose"),
    pytest.param(small_cnn, id="small_cnn_28x28"),
    pytest.param(frozen_kernels, id="frozen_kernels"),
]


@pytest.mark.parametrize("build", CASES)
def test_conv_rules_match_the_per_example_oracle(build: Callable[[], Case]) -> None:
    model, x, y, paths = build()
    plan = model.gradient_tracking_plan()
    for tracked in plan:
        if type(tracked.layer) in paths:
            assert tracked.path == paths[type(tracked.layer)], tracked.name
    assert {type(tracked.layer) for tracked in plan} >= set(paths)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y, statistics=STATISTICS), expected)


def test_dynamic_lengths_match_the_oracle() -> None:
    """Unknown spatial sizes (a retraced step with `None` lengths) take the dynamic path."""
    inputs = keras.Input((None, 3))
    hidden = L.Conv1D(4, 3, strides=2, padding="same")(inputs)
    hidden = L.Conv1DTranspose(3, 2, strides=2, padding="same")(hidden)
    model = classifier(inputs, L.GlobalAveragePooling1D()(hidden))
    assert [tracked.path for tracked in model.gradient_tracking_plan()][:2] == [
        "rule:conv",
        "rule:conv_transpose",
    ]
    for length in (7, 10):
        x, y = rng.normal(size=(BATCH, length, 3)), rng.integers(0, 3, BATCH)
        assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))


def random_reference(layer: keras.layers.Layer) -> Callable[[Any], tf.Tensor]:
    values = {id(v): tf.random.normal(v.shape) for v in layer.trainable_variables}
    return lambda variable: values[id(variable)]


def channels_first_twin(layer: keras.layers.Layer) -> keras.layers.Layer:
    return type(layer).from_config({**layer.get_config(), "data_format": "channels_first"})


# The two kernels of an ungrouped convolution's per-example filter gradients. The
# grouped Conv2DBackpropFilter runs only where TensorFlow runs oneDNN (`make test`
# runs this file with TF_ENABLE_ONEDNN_OPTS=1 and =0, whatever the CPU's default);
# the windows' products run everywhere, and are chosen here by the rule's switch.
KERNELS = ["onednn_grouped_filter", "window_products"]


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel the convolution rules use in this test."""
    if request.param == "onednn_grouped_filter" and not tensorflow_runs_onednn():
        pytest.skip("oneDNN is off in this process (TF_ENABLE_ONEDNN_OPTS=1 turns it on)")
    if request.param == "window_products":
        monkeypatch.setattr(filter_gradients, "onednn_cpu_only", lambda: False)
    return request.param


def tensorflow_runs_onednn() -> bool:
    """What TensorFlow itself reports, with no GPU to place the step on."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled()) and not tf.config.list_logical_devices("GPU")


MANY_CHANNEL_LAYERS = [
    (lambda: L.Conv1D(5, 3, strides=2, padding="causal", dilation_rate=1), (16, 6)),
    (lambda: L.Conv1D(4, 3, padding="same", dilation_rate=2, use_bias=False), (15, 8)),
    (lambda: L.Conv2D(5, 3, padding="same", strides=(2, 1)), (9, 8, 6)),
    (lambda: L.Conv2D(4, (3, 2), dilation_rate=(2, 1), activation="relu"), (10, 9, 7)),
    (lambda: L.Conv2DTranspose(3, 3, strides=2, padding="same"), (5, 6, 2)),
    (lambda: L.Conv1DTranspose(2, 3, strides=2), (7, 3)),
    (lambda: L.Conv2D(4, 1, strides=2), (7, 6, 8)),
]


@pytest.mark.parametrize(("make", "input_shape"), MANY_CHANNEL_LAYERS)
def test_many_channel_kernels_take_the_filter_gradient_onednn_runs(
    make: Callable[[], Any], input_shape: Any, kernel: str, tmp_path: Path
) -> None:
    """More than FEW_CHANNELS channels under the kernel's windows: the grouped
    Conv2DBackpropFilter where oneDNN runs it, the windows' products where it does
    not or the switch says so; both exact."""
    inputs = keras.Input(input_shape)
    layer = make()
    model = classifier(inputs, layer(inputs))
    (row, *_) = kgt.check(model).layers
    # A transposed convolution's windows slide over its output gradient: `filters` wide.
    windowed = layer.filters if "Transpose" in type(layer).__name__ else input_shape[-1]
    assert windowed > FEW_CHANNELS or "Transpose" in type(layer).__name__
    assert row.form == "materialized", row
    expected = (
        "Conv2DBackpropFilter (oneDNN), examples as groups"
        if kernel == "onednn_grouped_filter"
        and windowed > FEW_CHANNELS
        and layer.kernel_size != (1, 1)
        else "window products"  # also up to FEW_CHANNELS channels or 1x1, oneDNN or not
    )
    assert row.note == f"per-example kernel gradients: {expected}"
    x, y = rng.normal(size=(BATCH, *input_shape)), rng.integers(0, 3, BATCH)
    expected_statistics = oracle_statistics(model, x, y)
    assert_matches_oracle(
        model.gradient_statistics(x, y, statistics=STATISTICS), expected_statistics
    )
    # The batch gradient of a materialized layer is the sum of these per-example
    # gradients, so a step's update checks their layout too.
    plain = keras.Model.from_config(model.get_config())
    plain.compile(optimizer="sgd", loss=model.loss)
    plain.set_weights(model.get_weights())
    plain.fit(x, y, batch_size=BATCH, verbose=0)
    model.fit(
        x, y, batch_size=BATCH, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")]
    )
    assert model.gradient_tracking.forms[row.name] == "materialized"
    for actual, expected in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


CHUNKED_LAYERS = [
    (lambda: L.Conv2D(5, 3, padding="same", strides=(2, 1)), (9, 8, 6)),
    (lambda: L.Conv1D(4, 3, padding="same", use_bias=False), (15, 8)),
    (lambda: L.DepthwiseConv2D(3, depth_multiplier=2), (7, 6, 5)),
    (lambda: L.Conv2D(4, 3, padding="same"), (8, 7, 3)),
    (lambda: L.Conv2D(4, 3, groups=2), (8, 7, 6)),
    (lambda: L.Conv2DTranspose(3, 3, strides=2, padding="same"), (5, 6, 2)),
]


@pytest.mark.parametrize(("make", "input_shape"), CHUNKED_LAYERS)
def test_filter_gradients_in_chunks_of_examples_match_the_oracle(
    make: Callable[[], Any], input_shape: Any, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches larger than a chunk take the loop over chunks of examples, the last
    one short: the per-example gradients are the same, in the examples' order."""
    monkeypatch.setattr(chunks, "EXAMPLES_PER_CHUNK", 3)
    monkeypatch.setattr(chunks, "LARGE_BATCH_CHUNK", 3)
    assert BATCH > 3 and BATCH % 3
    inputs = keras.Input(input_shape)
    model = classifier(inputs, make()(inputs))
    x, y = rng.normal(size=(BATCH, *input_shape)), rng.integers(0, 3, BATCH)
    assert_matches_oracle(
        model.gradient_statistics(x, y, statistics=STATISTICS), oracle_statistics(model, x, y)
    )


def test_the_grouped_filter_gradient_runs_where_tensorflow_runs_onednn() -> None:
    """The rules read oneDNN from TensorFlow: an unset TF_ENABLE_ONEDNN_OPTS means on
    or off by the CPU (off without AVX-512 in TensorFlow 2.21); a set one decides."""
    assert grouped_filter_gradient_runs() == tensorflow_runs_onednn()
    assert not grouped_filter_gradient_runs(xla=True)
    flag = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").lower()
    if flag in ("0", "false"):
        assert not grouped_filter_gradient_runs()
    # x86-64 TensorFlow wheels hold oneDNN: `make test` relies on the flag turning it on.
    if flag in ("1", "true") and platform.machine().lower() in ("x86_64", "amd64"):
        assert grouped_filter_gradient_runs() == (not tf.config.list_logical_devices("GPU"))


def test_the_switch_chooses_the_window_products(kernel: str) -> None:
    windows = Window((3, 3), (1, 1), (1, 1), "valid")
    form = filter_gradients.filter_gradient_form(1, FEW_CHANNELS + 1, windows)
    assert (form == filter_gradients.GROUPED) == (kernel == "onednn_grouped_filter")


@pytest.mark.parametrize(
    ("make", "input_shape"),
    [
        (lambda: L.Conv1D(4, 3, strides=2, padding="causal"), (9, 2)),
        (lambda: L.Conv2D(4, 3, padding="same"), (5, 6, 2)),
        (lambda: L.Conv1DTranspose(3, 3, strides=2, padding="same"), (5, 2)),
        (lambda: L.Conv2DTranspose(3, 2, strides=2), (3, 4, 2)),
        (lambda: L.Conv3DTranspose(2, 2, strides=2, padding="same"), (2, 3, 2, 2)),
    ],
    ids=["conv1d", "conv2d", "conv1d_transpose", "conv2d_transpose", "conv3d_transpose"],
)
def test_channels_first_equals_channels_last(make: Callable[[], Any], input_shape: Any) -> None:
    """Where TensorFlow cannot train `channels_first` on CPU, the rule's channels_first
    handling is checked against its oracle-checked `channels_last` path."""
    last = make()
    x = tf.random.normal([BATCH, *input_shape])
    d = tf.random.normal(last(x).shape)
    first = channels_first_twin(last)
    first.build((BATCH, input_shape[-1], *input_shape[:-1]))
    first.set_weights(last.get_weights())
    to_first = [0, len(input_shape), *range(1, len(input_shape))]
    reference = random_reference(last)
    twins = {id(f): v for f, v in zip(first.trainable_variables, last.trainable_variables)}

    def reference_first(variable: Any) -> tf.Tensor:
        return reference(twins[id(variable)])

    rule = lookup(last).rule
    assert rule is not None
    expected = rule.primitives(last, [LayerCall((x,), {}, output_grads=[d])], reference)
    call_first = LayerCall(
        (tf.transpose(x, to_first),), {}, output_grads=[tf.transpose(d, to_first)]
    )
    found = rule.primitives(first, [call_first], reference_first)
    for name in ("sq_norm", "dot"):
        np.testing.assert_allclose(getattr(found, name), getattr(expected, name), rtol=1e-5)
    assert rule.per_example is not None
    found_grads = rule.per_example(first, [call_first])
    expected_grads = rule.per_example(last, [LayerCall((x,), {}, output_grads=[d])])
    assert len(found_grads) == len(expected_grads) == len(last.trainable_variables)
    for (_, found_grad), (_, expected_grad) in zip(found_grads, expected_grads):
        np.testing.assert_allclose(found_grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_untestable_or_replaced_kernels_use_the_fallback() -> None:
    """Dilated transposed convolutions (CPU TensorFlow runs them only under XLA) and
    LoRA kernels go to the exact fallback."""
    inputs = keras.Input((6, 6, 2))
    dilated = L.Conv2DTranspose(2, 3, dilation_rate=2)
    dilated.build((None, 6, 6, 2))
    lora = L.Conv2D(3, 3)
    hidden = lora(inputs)
    lora.enable_lora(2)
    model = classifier(inputs, hidden)
    assert lookup(dilated).rule is None
    assert "does not cover" in lookup(dilated).reason
    assert model.gradient_tracking_plan()[0].path == FALLBACK_PATH
    x, y = rng.normal(size=(BATCH, 6, 6, 2)), rng.integers(0, 3, BATCH)
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))


def test_jit_compiled_fit_with_conv_rules_is_exact(tmp_path: Path) -> None:
    """The rules compile under XLA; the logged statistics of a fitted step match the oracle."""
    inputs = keras.Input((6, 2))
    hidden = L.SeparableConv1D(4, 2, strides=2, padding="same", activation="relu")(inputs)
    hidden = L.Conv1DTranspose(2, 2, strides=2, activation="tanh")(hidden)
    model = classifier(inputs, hidden)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    assert all(tracked.rule is not None for tracked in model.gradient_tracking_plan())
    x, y = rng.normal(size=(8, 6, 2)), rng.integers(0, 3, 8)
    expected = oracle_statistics(model, x, y)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        logged = {name: log.per_example(name) for name in log.per_example_names}
        logged.update({name: log.per_step(name)[0] for name in log.per_step_names})
    assert_matches_oracle(logged, expected)

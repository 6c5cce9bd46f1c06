"""The JAX engine's convolution, normalization, EinsumDense, PReLU and LayerScale rules against the `jax.grad` oracle.

Every setting is a layer (strides, dilation, padding, 1-D to 3-D, groups, depth
multipliers, channels first, normalized axes, variants) under a small classifier:
its path must be its rule, not the fallback, and its statistics must match the
oracle's with the default statistics (dots with the batch gradient: cosines) and
with norm-only ones. Per-example gradients are also compared with the per-layer
fallback's directly, and the convolution's Gram form is checked forced on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax_oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack import rule_math
from keras_gradtrack._keras_seam import LayerScale
from keras_gradtrack.backends.jax import rules as jax_rules
from keras_gradtrack.backends.jax.plan import FALLBACK_PATH
from keras_gradtrack.backends.ops import conv as ops_conv
from keras_gradtrack.backends.ops import rules as ops_rules

BATCH = 5
NORM_ONLY = ["loss", "grad_norm", "layer_grad_norm", "batch_grad_norm", "gradient_diversity"]
RMS_SCALING_WARNING = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
L = keras.layers

# name -> (layer factory, input shape without the batch, expected path)
SETTINGS: dict[str, tuple[Callable[[], Any], tuple[int, ...], str]] = {
    "conv1d_causal_dilated": (
        lambda: L.Conv1D(3, 3, dilation_rate=2, padding="causal"),
        (9, 2),
        "rule:conv",
    ),
    "conv1d_same_strided": (lambda: L.Conv1D(3, 2, strides=2, padding="same"), (7, 2), "rule:conv"),
    "conv1d_groups": (lambda: L.Conv1D(4, 3, groups=2, activation="tanh"), (8, 4), "rule:conv"),
    "conv2d_valid_strided": (lambda: L.Conv2D(3, (3, 2), strides=(2, 1)), (7, 6, 2), "rule:conv"),
    "conv2d_same_dilated": (
        lambda: L.Conv2D(4, 3, dilation_rate=2, padding="same", activation="relu"),
        (7, 7, 2),
        "rule:conv",
    ),
    "conv2d_same_even_kernel_strided": (
        lambda: L.Conv2D(3, 4, strides=2, padding="same"),
        (8, 7, 3),
        "rule:conv",
    ),
    "conv2d_groups": (lambda: L.Conv2D(6, 3, groups=3, padding="same"), (5, 5, 3), "rule:conv"),
    "conv2d_channels_first": (
        lambda: L.Conv2D(3, 3, strides=2, padding="same", data_format="channels_first"),
        (2, 7, 7),
        "rule:conv",
    ),
    "conv2d_no_bias": (lambda: L.Conv2D(3, 2, use_bias=False), (5, 5, 2), "rule:conv"),
    # Few positions, many channels: the Gram form is the cheaper one here.
    "conv2d_gram_form": (lambda: L.Conv2D(16, 3), (4, 4, 8), "rule:conv"),
    "conv3d": (lambda: L.Conv3D(2, 2, strides=(1, 2, 1)), (4, 5, 4, 2), "rule:conv"),
    "depthwise_conv1d": (
        lambda: L.DepthwiseConv1D(3, depth_multiplier=2, strides=2, padding="same"),
        (9, 3),
        "rule:depthwise_conv",
    ),
    "depthwise_conv2d_dilated": (
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2, dilation_rate=2, padding="same"),
        (7, 7, 2),
        "rule:depthwise_conv",
    ),
    "depthwise_conv2d_channels_first": (
        lambda: L.DepthwiseConv2D((2, 3), data_format="channels_first", activation="relu"),
        (2, 5, 6),
        "rule:depthwise_conv",
    ),
    "separable_conv1d": (
        lambda: L.SeparableConv1D(4, 3, depth_multiplier=2, strides=2, padding="same"),
        (9, 3),
        "rule:separable_conv",
    ),
    "separable_conv2d_dilated": (
        lambda: L.SeparableConv2D(
            3, 3, depth_multiplier=2, dilation_rate=2, padding="same", activation="relu"
        ),
        (7, 7, 2),
        "rule:separable_conv",
    ),
    "separable_conv2d_strided_no_bias": (
        lambda: L.SeparableConv2D(4, 2, strides=2, use_bias=False),
        (6, 6, 3),
        "rule:separable_conv",
    ),
    # Transposed convolutions: the windows slide over the output gradient at the input's
    # positions ("same" with strides and an output padding; "valid"; 1-D to 3-D).
    "conv1d_transpose_same_strided": (
        lambda: L.Conv1DTranspose(3, 3, strides=2, padding="same"),
        (5, 2),
        "rule:conv_transpose",
    ),
    "conv2d_transpose_valid_strided": (
        lambda: L.Conv2DTranspose(3, (3, 2), strides=(2, 1)),
        (4, 3, 2),
        "rule:conv_transpose",
    ),
    "conv2d_transpose_output_padding": (
        lambda: L.Conv2DTranspose(2, 3, strides=2, padding="same", output_padding=1),
        (3, 4, 2),
        "rule:conv_transpose",
    ),
    "conv2d_transpose_channels_first": (
        lambda: L.Conv2DTranspose(2, 2, strides=2, data_format="channels_first"),
        (2, 3, 3),
        "rule:conv_transpose",
    ),
    "conv3d_transpose": (
        lambda: L.Conv3DTranspose(2, 2, strides=(1, 2, 1), padding="same"),
        (3, 2, 3, 2),
        "rule:conv_transpose",
    ),
    "prelu_shared_axes": (lambda: L.PReLU(shared_axes=[1]), (4, 3), "rule:prelu"),
    "prelu": (lambda: L.PReLU(), (3, 2), "rule:prelu"),
    "layer_scale": (lambda: LayerScale(1e-1, 3), (2, 2, 3), "rule:layer_scale"),
    # The equation's ellipsis, a bias over two axes, an input axis summed over first.
    "einsum_dense_ellipsis": (
        lambda: L.EinsumDense("...b,bc->...c", output_shape=4, bias_axes="c"),
        (4, 5),
        "rule:einsum_dense",
    ),
    "einsum_dense_heads": (
        lambda: L.EinsumDense("abc,cde->abde", output_shape=(3, 2, 4), bias_axes="de"),
        (3, 5),
        "rule:einsum_dense",
    ),
    "einsum_dense_summed_input_axis": (
        lambda: L.EinsumDense("abc,cd->ad", output_shape=4, bias_axes="d"),
        (3, 5),
        "rule:einsum_dense",
    ),
    "layer_normalization_two_axes": (
        lambda: L.LayerNormalization(axis=[1, 2]),
        (3, 4, 2),
        "rule:layer_normalization",
    ),
    "layer_normalization_middle_axis": (
        lambda: L.LayerNormalization(axis=1),
        (3, 4),
        "rule:layer_normalization",
    ),
    "layer_normalization_no_center": (
        lambda: L.LayerNormalization(center=False),
        (3, 4),
        "rule:layer_normalization",
    ),
    "layer_normalization_no_scale": (
        lambda: L.LayerNormalization(scale=False),
        (3, 4),
        "rule:layer_normalization",
    ),
    "layer_normalization_rms_scaling": (
        lambda: L.LayerNormalization(rms_scaling=True),
        (3, 4),
        "rule:layer_normalization",
    ),
    "rms_normalization": (lambda: L.RMSNormalization(), (3, 4), "rule:rms_normalization"),
    "rms_normalization_two_axes": (
        lambda: L.RMSNormalization(axis=[-2, -1]),
        (3, 4, 2),
        "rule:rms_normalization",
    ),
    "group_normalization_images": (
        lambda: L.GroupNormalization(2),
        (4, 4, 4),
        "rule:group_normalization",
    ),
    "group_normalization_channel_axis_1": (
        lambda: L.GroupNormalization(3, axis=1),
        (6, 4),
        "rule:group_normalization",
    ),
    "group_normalization_instance_no_center": (
        lambda: L.GroupNormalization(-1, center=False),
        (4, 3, 2),
        "rule:group_normalization",
    ),
}


# Settings whose every feature another setting covers (channels first, dilation, a
# separable convolution's stride, a group normalization's centering): `make test-all`.
EXTENDED = {
    "conv2d_same_dilated",
    "conv2d_transpose_channels_first",
    "prelu",
    "depthwise_conv2d_channels_first",
    "group_normalization_instance_no_center",
    "separable_conv2d_strided_no_bias",
}


def marks(name: str) -> list[Any]:
    found = [RMS_SCALING_WARNING] if "rms_scaling" in name else []
    return [*found, pytest.mark.extended] if name in EXTENDED else found


PARAMS = [pytest.param(name, marks=marks(name)) for name in sorted(SETTINGS)]


def built(name: str, seed: int = 0) -> tuple[Any, np.ndarray, np.ndarray]:
    """The setting's layer under a Dense head, compiled, and a batch of data."""
    factory, shape, _ = SETTINGS[name]
    rng = np.random.default_rng(seed)
    inputs = keras.Input(shape)
    features = L.Flatten()(factory()(inputs))
    model = kgt.GradientTrackingModel(inputs, L.Dense(3, name="head")(features))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    # Off-center inputs, so that the normalizations' centering matters.
    x = rng.normal(1.0, 2.0, size=(BATCH, *shape)).astype("float32")
    return model, x, rng.integers(0, 3, BATCH)


def tracked_layer(model: Any) -> Any:
    (tracked,) = [t for t in model.gradient_tracking_plan() if t.name != "head"]
    return tracked


@pytest.mark.parametrize("name", PARAMS)
def test_the_layer_is_on_its_rule_and_matches_the_oracle(name: str) -> None:
    model, x, y = built(name)
    assert tracked_layer(model).path == SETTINGS[name][2]
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y), expected)
    norm_only = model.gradient_statistics(x, y, statistics=NORM_ONLY)
    assert set(norm_only) - {"batch_size"} == set(NORM_ONLY)
    assert_matches_oracle(norm_only, expected)


def probed_call(model: Any, x: np.ndarray, seed: int = 1) -> tuple[Any, Any]:
    """The tracked layer and a call of it: its input in the model and a random output
    gradient."""
    layer = tracked_layer(model).layer
    inputs = keras.Model(model.input, layer.input)(x)
    output_shape = layer.compute_output_shape(inputs.shape)
    output_grad = jax.random.normal(jax.random.PRNGKey(seed), output_shape)
    return layer, ops_rules.ProbedCall(jnp.asarray(inputs), {}, output_grad)


# Keras' LayerScale has no `compute_output_shape`, which the fallback's trace needs:
# its rule is held to the oracle above.
@pytest.mark.parametrize("name", [p for p in PARAMS if p.values[0] != "layer_scale"])
def test_per_example_gradients_equal_the_fallbacks(name: str) -> None:
    model, x, _ = built(name)
    layer, call = probed_call(model, x)
    rule = tracked_layer(model).rule
    values = [v.value for v in layer.trainable_variables]
    others = [v.value for v in layer.non_trainable_variables]
    got = rule.per_example(layer, values, call, others)
    want = jax_rules.fallback_per_example(layer, values, call, others)
    assert [g.shape for g in got] == [w.shape for w in want]
    for variable, g, w in zip(layer.trainable_variables, got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=variable.name)


CONV_GRAM = sorted(
    name for name, (_, _, path) in SETTINGS.items() if path == "rule:conv" and "groups" not in name
)


@pytest.mark.parametrize("name", CONV_GRAM)
def test_the_conv_gram_form_gives_the_per_example_primitives(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rule_math, "gram_is_cheaper", lambda *args, **kwargs: True)
    model, x, _ = built(name)
    layer, call = probed_call(model, x)
    values = [v.value for v in layer.trainable_variables]
    flat = jnp.concatenate(
        [g.reshape(BATCH, -1) for g in ops_conv.conv_per_example(layer, values, call)], axis=1
    )
    refs = [jax.random.normal(jax.random.PRNGKey(2), v.shape) for v in layer.trainable_variables]
    reference = jnp.concatenate([r.reshape(-1) for r in refs])
    primitives = ops_conv.conv_primitives(layer, call, refs)
    np.testing.assert_allclose(primitives.sq_norm, jnp.sum(flat**2, axis=1), rtol=1e-4)
    np.testing.assert_allclose(primitives.dot, flat @ reference, rtol=1e-4, atol=1e-4)
    if primitives.sum_sq_norm is None:  # a call with a reference factor: the step's ||G||^2/c^2
        return
    np.testing.assert_allclose(primitives.sum_sq_norm, jnp.sum(jnp.sum(flat, 0) ** 2), rtol=1e-4)
    norm_only = ops_conv.conv_primitives(layer, call, None)
    assert norm_only.dot is None
    np.testing.assert_allclose(norm_only.sq_norm, primitives.sq_norm, rtol=1e-6)


@pytest.mark.parametrize("name", ["conv1d_causal_dilated", "conv2d_channels_first"])
def test_the_step_on_the_conv_gram_form_matches_the_oracle(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rule_math, "gram_is_cheaper", lambda *args, **kwargs: True)
    model, x, y = built(name)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y), expected)
    assert_matches_oracle(model.gradient_statistics(x, y, statistics=NORM_ONLY), expected)


def test_the_gram_form_is_chosen_only_where_it_is_cheaper() -> None:
    # Few positions and many channels: Gram; the zoo CNN's 24x24 maps: materialized.
    assert rule_math.gram_is_cheaper(4, 72, 16, dots=True)
    assert not rule_math.gram_is_cheaper(576, 288, 32, dots=True)
    assert not rule_math.gram_is_cheaper(676, 9, 32, dots=False)


def test_layers_the_rules_do_not_cover_are_on_the_fallback_and_say_so() -> None:
    inputs = keras.Input((3, 4))
    hidden = L.RMSNormalization(axis=1)(inputs)  # not the trailing axes: scale misaligned
    hidden = L.Conv1DTranspose(2, 2, dilation_rate=2)(hidden)  # dilated: as on TensorFlow
    lora = L.Dense(3)
    hidden = lora(L.Flatten()(hidden))
    lora.enable_lora(2)  # its variables are the low-rank factors: a rule of their own
    model = kgt.GradientTrackingModel(inputs, L.Dense(2)(hidden))
    paths = [tracked.path for tracked in model.gradient_tracking_plan()]
    assert paths == [FALLBACK_PATH, FALLBACK_PATH, "rule:lora_dense", "rule:dense"]


def flat_per_example(grads: list[Any]) -> Any:
    return jnp.concatenate([g.reshape(BATCH, -1) for g in grads], axis=1)


def assert_primitives_match(primitives: Any, flat: Any, refs: list[Any]) -> None:
    """The primitives against those of the per-example gradients `flat` (B, n)."""
    reference = jnp.concatenate([jnp.reshape(r, -1) for r in refs])
    np.testing.assert_allclose(primitives.sq_norm, jnp.sum(flat**2, axis=1), rtol=1e-4)
    np.testing.assert_allclose(primitives.dot, flat @ reference, rtol=1e-4, atol=1e-4)
    if primitives.sum_sq_norm is None:  # a call with a reference factor: the step's ||G||^2/c^2
        return
    np.testing.assert_allclose(primitives.sum_sq_norm, jnp.sum(jnp.sum(flat, 0) ** 2), rtol=1e-4)


def test_dense_takes_the_gram_form_only_where_it_holds_fewer_values() -> None:
    # GPT-2 small's MLP kernel (768 x 3072): at batch 64 its per-example gradients are over
    # the budget; two (128, 128) Gram matrices per example hold fewer values, two
    # (4096, 4096) ones far more. Under the budget, materialized at any length.
    assert ops_rules.dense_takes_gram_form(64, 128, 768, 3072)
    assert not ops_rules.dense_takes_gram_form(64, 4096, 768, 3072)
    assert not ops_rules.dense_takes_gram_form(8, 128, 768, 3072)


def test_dense_on_sequences_in_the_gram_form_gives_the_per_example_primitives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `rule_math.gram_sq_norms`, as for layers too large to materialize.
    monkeypatch.setattr(ops_rules, "MATERIALIZED_VALUES", 0)
    rng = np.random.default_rng(3)
    layer = L.Dense(4)
    layer.build((None, 3, 6))
    a = jnp.asarray(rng.normal(size=(BATCH, 3, 6)), jnp.float32)
    d = jnp.asarray(rng.normal(size=(BATCH, 3, 4)), jnp.float32)
    call = ops_rules.ProbedCall(inputs=a, kwargs={}, output_grad=d)
    values = [v.value for v in layer.trainable_variables]
    flat = flat_per_example(ops_rules.dense_per_example(layer, values, call))
    refs = [jnp.asarray(rng.normal(size=v.shape), jnp.float32) for v in layer.trainable_variables]
    assert_primitives_match(ops_rules.dense_primitives(layer, call, refs), flat, refs)


def test_dense_on_sequences_under_the_budget_is_materialized_by_the_step() -> None:
    # No direct form: the step takes the norms, the dots and (for a loss `c sum_i l_i`)
    # the batch gradient from `dense_per_example` (`sums_batch_gradient`).
    layer = L.Dense(4)
    layer.build((None, 3, 6))
    a, d = jnp.ones((BATCH, 3, 6)), jnp.ones((BATCH, 3, 4))
    call = ops_rules.ProbedCall(inputs=a, kwargs={}, output_grad=d)
    refs = [jnp.ones(v.shape) for v in layer.trainable_variables]
    assert ops_rules.dense_primitives(layer, call, refs) is None
    assert ops_rules.DENSE.sums_batch_gradient and ops_rules.EINSUM_DENSE.sums_batch_gradient


@pytest.mark.parametrize("reference_factor", [None, 0.5])
def test_dense_on_rows_gives_the_per_example_primitives(reference_factor: float | None) -> None:
    # B (in + out) < in out: with the batch gradient as the reference, the dot comes from
    # the Gram matrices (`rule_math.gram_has_fewer_products`); without, directly.
    rng = np.random.default_rng(4)
    layer = L.Dense(40)
    layer.build((None, 6))
    assert rule_math.gram_has_fewer_products(BATCH, 6, 40)
    a = jnp.asarray(rng.normal(size=(BATCH, 6)), jnp.float32)
    d = jnp.asarray(rng.normal(size=(BATCH, 40)), jnp.float32)
    call = ops_rules.ProbedCall(
        inputs=a, kwargs={}, output_grad=d, reference_factor=reference_factor
    )
    values = [v.value for v in layer.trainable_variables]
    grads = ops_rules.dense_per_example(layer, values, call)
    factor = 1.0 if reference_factor is None else reference_factor
    refs = [factor * jnp.sum(g, axis=0) for g in grads]  # the batch gradient, c sum_i g_i
    assert_primitives_match(
        ops_rules.dense_primitives(layer, call, refs), flat_per_example(grads), refs
    )


def test_embedding_primitives_group_repeated_and_negative_ids() -> None:
    # ids -1 and 6 are one row of 7 (`ops.take` wraps negative ids), as are 2 and -5.
    rng = np.random.default_rng(6)
    layer = L.Embedding(7, 3)
    layer.build((None, 4))
    ids = jnp.asarray([[0, -1, 6, 2], [2, -5, 3, 3], [1, 1, 1, 1], [4, 5, -7, 0], [6, 6, -1, 2]])
    d = jnp.asarray(rng.normal(size=(BATCH, 4, 3)), jnp.float32)
    call = ops_rules.ProbedCall(inputs=ids, kwargs={}, output_grad=d)
    values = [v.value for v in layer.trainable_variables]
    flat = flat_per_example(ops_rules.embedding_per_example(layer, values, call))
    refs = [jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)]
    assert_primitives_match(ops_rules.embedding_primitives(layer, call, refs), flat, refs)

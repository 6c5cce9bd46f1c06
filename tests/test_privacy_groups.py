"""Bounds per group of layers: `make_private(l2_norm_clip={group: C_k}, groups={group: layers})`.

With the noise off and SGD at learning rate 1, one step moves the weights by
`-sum_i sum_k min(1, C_k / ||g_i^(k)||) g_i^(k) / B`, `g_i^(k)` example i's gradient
(`tests/oracle.py`, one tape per example) restricted to group k's layers.
"""

from __future__ import annotations

import json
from typing import Any

import h5py
import keras
import numpy as np
import oracle
import pytest
from keras import layers
from test_privacy import RTOL, compiled, private_update

import keras_gradtrack as kgt


def two_branch_model() -> tuple[Any, dict[str, Any]]:
    """Images through a nested Sequential of two Conv2D, ids through Embedding and
    LayerNormalization, a Dense head on both: the model and its layers."""
    image_encoder = keras.Sequential(
        [layers.Conv2D(3, 3, activation="relu"), layers.Conv2D(2, 3, strides=2, padding="same")],
        name="image_encoder",
    )
    embedding, norm = layers.Embedding(10, 4), layers.LayerNormalization()
    head = layers.Dense(3, name="head")
    images = keras.Input((6, 6, 2))
    ids = keras.Input((5,), dtype="int32")
    pooled_images = layers.GlobalAveragePooling2D()(image_encoder(images))
    pooled_ids = layers.GlobalAveragePooling1D()(norm(embedding(ids)))
    outputs = head(layers.Concatenate()([pooled_images, pooled_ids]))
    model = compiled(kgt.GradientTrackingModel([images, ids], outputs))
    return model, {"image_encoder": image_encoder, "embedding": embedding, "norm": norm}


def batch() -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(30)
    ids = rng.integers(0, 10, size=(8, 5))
    ids[:, 0] = 3  # an id every example uses
    return [rng.normal(size=(8, 6, 6, 2)).astype("float32"), ids], np.arange(8) % 3


def group_norms(
    model: Any, x: Any, y: Any, groups: dict[str, list[str]]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The oracle's per-example gradients by layer, and each group's `(B,)` norms."""
    found = oracle.per_example_gradients(model, x, y)
    by_layer = dict(zip(found["layers"], found["g"]))
    assert sorted(n for names in groups.values() for n in names) == sorted(by_layer)
    norms = {
        group: np.sqrt(sum(np.sum(by_layer[name] ** 2, axis=1) for name in names))
        for group, names in groups.items()
    }
    return by_layer, norms


def group_clipped_mean(
    by_layer: dict[str, np.ndarray],
    norms: dict[str, np.ndarray],
    groups: dict[str, list[str]],
    bounds: dict[str, float],
) -> np.ndarray:
    """`sum_i sum_k min(1, C_k / ||g_i^(k)||) g_i^(k) / B`, in the oracle's column order."""
    group_of = {name: group for group, names in groups.items() for name in names}
    parts = [
        (np.minimum(1.0, bounds[group_of[name]] / norms[group_of[name]])[:, None] * g).sum(0)
        for name, g in by_layer.items()
    ]
    return np.concatenate(parts) / len(next(iter(by_layer.values())))


def medians(norms: dict[str, np.ndarray]) -> dict[str, float]:
    """Each group's bound at its median norm: some examples clipped, some not."""
    return {group: float(np.median(n)) for group, n in norms.items()}


def test_group_bounds_clip_each_group() -> None:
    """Groups given by a composite layer's name, by layer objects and by a tracked
    layer's name; each group's part is clipped to its own bound."""
    model, parts = two_branch_model()
    x, y = batch()
    names = model.tracked_layer_names
    groups = {
        "image": [n for n in names if n.startswith("conv2d")],
        "text": [parts["embedding"].name, parts["norm"].name],
        "head": ["head"],
    }
    by_layer, norms = group_norms(model, x, y, groups)
    bounds = medians(norms)
    expected = group_clipped_mean(by_layer, norms, groups, bounds)
    model.make_private(
        l2_norm_clip=bounds,
        noise_multiplier=0.0,
        groups={
            "image": ["image_encoder"],
            "text": [parts["embedding"], parts["norm"]],
            "head": "head",
        },
    )
    update = private_update(model, x, y)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())
    # Not what one bound over all layers would give.
    _, total = group_norms(model, x, y, {"all": names})
    flat = group_clipped_mean(by_layer, total, {"all": names}, medians(total))
    assert not np.allclose(expected, flat, rtol=1e-3)


def test_one_bound_for_every_group_and_the_sensitivity() -> None:
    model, parts = two_branch_model()
    x, y = batch()
    names = model.tracked_layer_names
    text = [parts["embedding"].name, parts["norm"].name]
    groups = {"text": text, "rest": [n for n in names if n not in text]}
    by_layer, norms = group_norms(model, x, y, groups)
    clip = min(medians(norms).values())
    expected = group_clipped_mean(by_layer, norms, groups, dict.fromkeys(groups, clip))
    model.make_private(l2_norm_clip=clip, noise_multiplier=1.0, groups=groups)
    assert model.privacy_settings.sensitivity == pytest.approx(clip * np.sqrt(2))
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0, groups=groups)
    update = private_update(model, x, y)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_noise_of_groups_has_standard_deviation_sigma_root_sum_of_squares() -> None:
    x = np.random.default_rng(31).normal(size=(16, 40)).astype("float32")
    y = np.arange(16) % 30
    first, second = layers.Dense(30, name="first"), layers.Dense(30, name="second")

    def update(noise: float) -> np.ndarray:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((40,))
        model = compiled(kgt.GradientTrackingModel(inputs, second(first(inputs))))
        model.make_private(
            l2_norm_clip={"a": 0.3, "b": 0.4},
            noise_multiplier=noise,
            groups={"a": [first], "b": ["second"]},
        )
        return private_update(model, x, y)

    noise = update(1.5) - update(0.0)
    std = 1.5 * 0.5 / 16  # sqrt(0.3^2 + 0.4^2) = 0.5
    relative_error = 1 / np.sqrt(2 * noise.size)
    assert abs(noise.std() / std - 1) < 5 * relative_error, (noise.std(), std)


def three_layers() -> Any:
    return compiled(
        kgt.GradientTrackingSequential(
            [
                keras.Input((5,)),
                layers.Dense(4, name="a"),
                layers.Dense(4, name="b"),
                layers.Dense(3, name="c"),
            ]
        )
    )


@pytest.mark.parametrize(
    ("bounds", "groups", "message"),
    [
        ({"x": 1.0, "y": 1.0}, {"x": ["a", "b"], "y": ["b", "c"]}, "is in groups 'x' and 'y'"),
        ({"x": 1.0}, {"x": ["a", "b"]}, r"Tracked layers \['c'\] .* are in no group"),
        ({"x": 1.0, "y": 1.0}, {"x": ["a", "b"], "y": ["nope"]}, "Received: 'nope'"),
        ({"x": 1.0}, {"x": ["a", "b"], "y": ["c"]}, "one bound per group"),
        ({"x": 1.0}, {"x": []}, "non-empty list"),
        ({"x": 1.0}, ["a", "b", "c"], "non-empty dict"),
    ],
)
def test_bad_groups_are_refused_at_make_private(bounds: Any, groups: Any, message: str) -> None:
    model = three_layers()
    with pytest.raises(ValueError, match=message):
        model.make_private(l2_norm_clip=bounds, noise_multiplier=1.0, groups=groups)
    assert model.privacy_settings is None


def test_a_layer_of_another_model_is_refused() -> None:
    model = three_layers()
    with pytest.raises(ValueError, match="names no tracked layer"):
        model.make_private(
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            groups={"x": model.layers, "y": [layers.Dense(2)]},
        )


class TwoDense(kgt.GradientTrackingMixin, keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = layers.Dense(4, name="hidden")
        self.out = layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


def test_bad_groups_of_an_unbuilt_model_are_refused_before_any_weight_changes() -> None:
    """A subclassed model is built by its first step: the groups are checked then, as
    the step is traced, before any weight changes."""
    model = compiled(TwoDense())
    model.make_private(l2_norm_clip=1.0, noise_multiplier=0.0, groups={"x": ["hidden"]})
    x = np.random.default_rng(32).normal(size=(8, 5)).astype("float32")
    model(x[:1])
    before = [v.numpy() for v in model.variables]
    with pytest.raises(ValueError, match=r"Tracked layers \['out'\]"):
        model.fit(x, np.arange(8) % 3, batch_size=8, verbose=0)
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_the_log_holds_the_groups_and_the_fraction_clipped_per_group(tmp_path: Any) -> None:
    model, parts = two_branch_model()
    x, y = batch()
    names = model.tracked_layer_names
    text = [parts["embedding"].name, parts["norm"].name]
    groups = {"text": text, "rest": [n for n in names if n not in text]}
    _, norms = group_norms(model, x, y, groups)
    # The text group clips a quarter of the examples, the rest none.
    bounds = {"text": float(np.quantile(norms["text"], 0.75)), "rest": 2 * norms["rest"].max()}
    clipped = np.any([norms[group] > bounds[group] for group in groups], axis=0)
    assert clipped.mean() == 0.25
    model.make_private(l2_norm_clip=bounds, noise_multiplier=0.0, groups=groups)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["grad_norm"])
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[logger])
    assert history.history["dp_fraction_clipped"] == [pytest.approx(clipped.mean())]
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.per_step("dp_fraction_clipped")[0] == pytest.approx(clipped.mean())
    with h5py.File(tmp_path / "run.h5", "r") as file:
        assert json.loads(file.attrs["dp_clip_groups"]) == groups
        assert file.attrs["dp_l2_norm_clip"] == pytest.approx(np.hypot(*bounds.values()))
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        summary = log.summary()
    rest = len(groups["rest"])
    assert (
        f"DP-SGD, bounds per group: text C={bounds['text']:.4g} (2 layers), rest "
        f"C={bounds['rest']:.4g} ({rest} layers) (sensitivity "
        f"{np.hypot(*bounds.values()):.4g}), sigma=0" in summary
    )


@pytest.mark.parametrize(
    "bounds, groups, expected",
    [
        (
            {"d1": 0.5, "d2": 0.25},
            None,
            "bounds per layer: d1 C=0.5, d2 C=0.25 (sensitivity 0.559)",
        ),
        (
            1.0,
            {"a": ["d1"], "b": ["d2"]},
            "bounds per group: a C=1 (1 layer), b C=1 (1 layer) (sensitivity 1.414)",
        ),
    ],
)
def test_the_summary_says_each_bound(
    tmp_path: Any, bounds: Any, groups: Any, expected: str
) -> None:
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((5,)), layers.Dense(4, name="d1"), layers.Dense(3, name="d2")]
        )
    )
    model.make_private(l2_norm_clip=bounds, noise_multiplier=0.0, groups=groups)
    x = np.random.default_rng(33).normal(size=(8, 5)).astype("float32")
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss"])
    model.fit(x, np.arange(8) % 3, batch_size=8, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert f"DP-SGD, {expected}, sigma=0" in log.summary()

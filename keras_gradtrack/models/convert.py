"""`convert_to_group_normalization`: BatchNormalization replaced by GroupNormalization.

This is what Opacus does to a model with BatchNormalization (`ModuleValidator.fix`):
GroupNormalization normalizes each example with its own statistics, so examples
stay independent and per-example gradients are those of a model without any
coupling. It is a change of the model, not a view of the same one: the layers
compute something else (no moving statistics, the same function in training and
inference), and a network designed and tuned with BatchNormalization may train
differently.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack._keras_seam import Functional, flatten_layers


def group_count(channels: int, groups: int) -> int:
    """The largest divisor of `channels` that is at most `groups`."""
    return max(g for g in range(1, min(groups, channels) + 1) if channels % g == 0)


# The options a GroupNormalization takes from the BatchNormalization it replaces: the
# two layers name them alike.
SHARED_OPTIONS = (
    "axis",
    "epsilon",
    "center",
    "scale",
    "beta_initializer",
    "gamma_initializer",
    "beta_regularizer",
    "gamma_regularizer",
    "beta_constraint",
    "gamma_constraint",
)


def group_normalization_like(layer: Any, groups: int) -> keras.layers.GroupNormalization:
    """A GroupNormalization with the BatchNormalization's axis, epsilon, and affine options."""
    channels = int(layer.moving_mean.shape[0])
    return keras.layers.GroupNormalization(
        groups=group_count(channels, groups),
        name=layer.name,
        dtype=layer.dtype_policy,
        **{option: getattr(layer, option) for option in SHARED_OPTIONS},
    )


def convert_to_group_normalization(model: keras.Model, groups: int = 32) -> keras.Model:
    """A copy of `model` whose trainable BatchNormalization layers are GroupNormalization.

    Each trainable BatchNormalization becomes a GroupNormalization over the same
    channel axis, with the largest number of groups up to `groups` that divides
    its channels, the same epsilon, and its gamma and beta as initial values.
    Frozen BatchNormalization layers (`trainable=False`) stay: they run in
    inference mode, one example at a time. Every other layer is copied with its
    weights; nested functional or Sequential models are converted too. The
    original model is left as it was; the copy is compiled like it, if it was
    compiled.

    This changes the model (see the module docstring): choose it to train from
    scratch with examples independent of each other (as differential privacy
    requires). To keep BatchNormalization, freeze it for fine-tuning, or set
    `model.track_batch_normalization = True` for exact per-example gradients
    through the batch statistics.

    Args:
        model: A built functional or Sequential model.
        groups: The largest number of groups per layer (Opacus' default, 32).

    Returns:
        The converted model, of the same class for functional and Sequential models.

    Raises:
        ValueError: If `model` is subclassed or not built, or `groups` is not a
            positive int.

    Example:

    ```python
    base = keras.applications.ResNet50V2(weights=None, include_top=False, pooling="avg")
    inputs = keras.Input((224, 224, 3))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(10)(base(inputs)))
    model = kgt.convert_to_group_normalization(model)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    ```
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"Expected groups to be a positive int. Received: groups={groups!r}")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise ValueError(
            "Expected a functional or Sequential model (a subclassed model's layers are "
            "created in its own code: use keras.layers.GroupNormalization there). "
            f"Received: {type(model).__name__}"
        )
    if not model.built:
        raise ValueError(f"Expected a built model. Received: model {model.name!r}, not built")
    pairs: list[tuple[Any, Any]] = []

    def clone_layer(layer: Any) -> Any:
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            clone = group_normalization_like(layer, groups)
        else:
            clone = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, clone))
        return clone

    def call_layer(layer: Any, *args: Any, **kwargs: Any) -> Any:
        # A functional graph replays BatchNormalization's `mask` argument, which
        # GroupNormalization does not take (it ignores masks either way).
        if isinstance(layer, keras.layers.GroupNormalization):
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    functional = not isinstance(model, keras.Sequential)
    converted = keras.models.clone_model(
        model,
        clone_function=clone_layer,
        call_function=call_layer if functional else None,
        recursive=True,
    )
    for original, clone in pairs:
        if isinstance(clone, keras.layers.GroupNormalization) and isinstance(
            original, keras.layers.BatchNormalization
        ):
            # GroupNormalization's weights are gamma then beta, each present as configured.
            clone.set_weights([w.numpy() for w in (original.gamma, original.beta) if w is not None])
        else:
            clone.set_weights(original.get_weights())
    for original, clone in zip(nested_models(model), nested_models(converted)):
        if not original.trainable:
            clone.trainable = False
    return converted


def nested_models(model: keras.Model) -> list[keras.Model]:
    """The models inside `model`, in the order Keras lists its layers."""
    return [
        layer
        for layer in flatten_layers(model, include_self=False)
        if isinstance(layer, keras.Model)
    ]

"""Models of the probed engines' tests (JAX, PyTorch): an MLP, a CNN and a Transformer
block, each built with a given model class (`kgt.GradientTrackingModel` or `keras.Model`)."""

from __future__ import annotations

from typing import Any

import keras


class ChannelScale(keras.layers.Layer):
    """A layer of one's own with a weight and no rule (`y = x * w` over the last axis):
    the per-layer fallback's."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x: Any) -> Any:
        return x * self.w


def head(model_class: type, inputs: Any, features: Any, classes: int = 3) -> Any:
    if len(features.shape) > 2:
        features = keras.layers.Flatten()(features)
    return model_class(inputs, keras.layers.Dense(classes, name="head")(features))


def mlp(model_class: type) -> Any:
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.Dense(16, activation="relu")(hidden)
    return head(model_class, inputs, hidden)


def cnn(model_class: type) -> Any:
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    hidden = keras.layers.Conv2D(4, 3, activation="relu")(hidden)
    return head(model_class, inputs, hidden)


def transformer_block(model_class: type, length: int = 6, dim: int = 8) -> Any:
    inputs = keras.Input((length, dim))
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    hidden = keras.layers.LayerNormalization()(inputs + attended)
    feed_forward = keras.layers.Dense(16, activation="relu")(hidden)
    feed_forward = keras.layers.Dense(dim)(feed_forward)
    hidden = keras.layers.LayerNormalization()(hidden + feed_forward)
    return head(model_class, inputs, keras.layers.GlobalAveragePooling1D()(hidden))


def separable_cnn(model_class: type) -> Any:
    """Every convolution and normalization rule of the JAX engine in one model."""
    inputs = keras.Input((8, 8, 2))
    hidden = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    hidden = keras.layers.GroupNormalization(2)(hidden)
    hidden = keras.layers.SeparableConv2D(6, 3, strides=2, activation="relu")(hidden)
    hidden = keras.layers.DepthwiseConv2D(2, depth_multiplier=2)(hidden)
    hidden = keras.layers.LayerNormalization()(hidden)
    hidden = keras.layers.Reshape((4, 12))(hidden)
    hidden = keras.layers.Conv1D(4, 2, padding="causal")(hidden)
    hidden = keras.layers.SeparableConv1D(4, 2, depth_multiplier=2)(hidden)
    hidden = keras.layers.DepthwiseConv1D(2)(hidden)
    hidden = keras.layers.RMSNormalization()(hidden)
    return head(model_class, inputs, hidden)


# name -> (builder, input shape without the batch)
MODELS = {
    "mlp": (mlp, (12,)),
    "cnn": (cnn, (8, 8, 1)),
    "transformer_block": (transformer_block, (6, 8)),
    "separable_cnn": (separable_cnn, (8, 8, 2)),
}


def compiled(model: Any) -> Any:
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model

"""The benchmark zoo: the models `overhead.py` measures, each with its data and loss.

Adding a model is one function and one line: write a builder that takes the model
class (`keras.Model` for plain fit, `kgt.GradientTrackingModel` for tracked fit) and
returns the built model, then add a `Spec` to `ZOO`:

```python
def tiny(model_class):
    inputs = keras.Input((8,))
    return model_class(inputs, keras.layers.Dense(3)(inputs), name="tiny")

ZOO["tiny"] = Spec(tiny, Images((8,), classes=3), "Dense(3) on 8 floats")
```

`Spec.data` says what the inputs and targets are (`Images`, `Tokens`, `Reconstruction`),
`Spec.jit_compile` compiles plain and tracked steps with XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

L = keras.layers


@dataclasses.dataclass(frozen=True)
class Images:
    """Float inputs of `shape` with integer class labels (logits, sparse cross-entropy)."""

    shape: tuple[int, ...]
    classes: int = 10

    def batches(self, size: int, rng: np.random.Generator) -> tuple[Any, Any]:
        x = rng.standard_normal((size, *self.shape), dtype=np.float32)
        return x, rng.integers(0, self.classes, size)

    def loss(self) -> Any:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclasses.dataclass(frozen=True)
class Tokens(Images):
    """Token ids in `[0, vocabulary)` of length `shape[0]`, integer class labels."""

    vocabulary: int = 1000

    def batches(self, size: int, rng: np.random.Generator) -> tuple[Any, Any]:
        x = rng.integers(0, self.vocabulary, (size, *self.shape), dtype=np.int32)
        return x, rng.integers(0, self.classes, size)


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """Images in [0, 1] to be reconstructed from a noisy copy (per-pixel binary cross-entropy)."""

    shape: tuple[int, ...]

    def batches(self, size: int, rng: np.random.Generator) -> tuple[Any, Any]:
        clean = rng.uniform(size=(size, *self.shape)).astype(np.float32)
        noisy = np.clip(clean + 0.3 * rng.standard_normal(clean.shape), 0, 1).astype(np.float32)
        return noisy, clean

    def loss(self) -> Any:
        return keras.losses.BinaryCrossentropy()


@dataclasses.dataclass(frozen=True)
class Spec:
    """One model of the zoo.

    Attributes:
        build: `build(model_class)` -> the model (functional, built).
        data: Its inputs, targets and loss.
        description: One line for the table of models.
        jit_compile: Compile plain and tracked steps with XLA.
    """

    build: Callable[[type], Any]
    data: Images | Reconstruction
    description: str
    jit_compile: bool | str = "auto"


# -- the four models of the first benchmark ----------------------------------------------


def mlp(model_class: type) -> Any:
    inputs = keras.Input((784,))
    hidden = L.Dense(256, activation="relu")(inputs)
    hidden = L.Dense(256, activation="relu")(hidden)
    return model_class(inputs, L.Dense(10)(hidden), name="mlp")


def cnn(model_class: type) -> Any:
    inputs = keras.Input((28, 28, 1))
    hidden = L.Conv2D(32, 3, activation="relu")(inputs)
    hidden = L.Conv2D(32, 3, activation="relu")(hidden)
    return model_class(inputs, L.Dense(10)(L.Flatten()(hidden)), name="cnn")


def text(model_class: type) -> Any:
    inputs = keras.Input((32,), dtype="int32")
    hidden = L.Embedding(1000, 64)(inputs)
    hidden = L.Dense(64, activation="relu")(hidden)
    hidden = L.LayerNormalization()(hidden)
    outputs = L.Dense(2)(L.GlobalAveragePooling1D()(hidden))
    return model_class(inputs, outputs, name="text")


def transformer(model_class: type) -> Any:
    inputs = keras.Input((32,), dtype="int32")
    hidden = L.Embedding(1000, 64)(inputs)
    attended = L.MultiHeadAttention(num_heads=4, key_dim=16)(hidden, hidden)
    hidden = L.LayerNormalization()(L.Add()([hidden, attended]))
    feed_forward = L.Dense(64)(L.Dense(128, activation="relu")(hidden))
    hidden = L.LayerNormalization()(L.Add()([hidden, feed_forward]))
    outputs = L.Dense(2)(L.GlobalAveragePooling1D()(hidden))
    return model_class(inputs, outputs, name="transformer")


# -- real architectures --------------------------------------------------------------------


def mobilenet(model_class: type) -> Any:
    """Keras' MobileNetV2 (width 0.35, random weights) with BatchNormalization frozen, as
    when fine-tuning: inverted residual blocks of pointwise and depthwise convolutions."""
    base = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, include_top=False, pooling="avg"
    )
    for layer in base.layers:
        if isinstance(layer, L.BatchNormalization):
            layer.trainable = False
    outputs = L.Dense(10)(base.output)
    return model_class(base.input, outputs, name="mobilenet")


def separable(model_class: type) -> Any:
    """keras.io's image classifier from scratch (SeparableConv2D residual blocks), with
    GroupNormalization in place of BatchNormalization, narrower, on 32x32 images."""
    inputs = keras.Input((32, 32, 3))
    hidden = L.Conv2D(16, 3, strides=2, padding="same")(inputs)
    hidden = L.Activation("relu")(L.GroupNormalization(8)(hidden))
    previous = hidden
    for width in (32, 64, 128):
        hidden = L.Activation("relu")(hidden)
        hidden = L.GroupNormalization(8)(L.SeparableConv2D(width, 3, padding="same")(hidden))
        hidden = L.Activation("relu")(hidden)
        hidden = L.GroupNormalization(8)(L.SeparableConv2D(width, 3, padding="same")(hidden))
        hidden = L.MaxPooling2D(3, strides=2, padding="same")(hidden)
        residual = L.Conv2D(width, 1, strides=2, padding="same")(previous)
        hidden = previous = L.add([hidden, residual])
    hidden = L.SeparableConv2D(256, 3, padding="same")(hidden)
    hidden = L.Activation("relu")(L.GroupNormalization(8)(hidden))
    hidden = L.Dropout(0.25)(L.GlobalAveragePooling2D()(hidden))
    return model_class(inputs, L.Dense(10)(hidden), name="separable")


def autoencoder(model_class: type) -> Any:
    """keras.io's denoising autoencoder: two Conv2D + pooling, two Conv2DTranspose."""
    inputs = keras.Input((28, 28, 1))
    hidden = L.Conv2D(32, 3, activation="relu", padding="same")(inputs)
    hidden = L.MaxPooling2D(2, padding="same")(hidden)
    hidden = L.Conv2D(32, 3, activation="relu", padding="same")(hidden)
    hidden = L.MaxPooling2D(2, padding="same")(hidden)
    hidden = L.Conv2DTranspose(32, 3, strides=2, activation="relu", padding="same")(hidden)
    hidden = L.Conv2DTranspose(32, 3, strides=2, activation="relu", padding="same")(hidden)
    outputs = L.Conv2D(1, 3, activation="sigmoid", padding="same")(hidden)
    return model_class(inputs, outputs, name="autoencoder")


def resnet(model_class: type) -> Any:
    """A ResNet-8 for 32x32 images: three stages of one basic block (16, 32, 64
    channels), GroupNormalization, projection shortcuts where the shape changes."""
    inputs = keras.Input((32, 32, 3))

    def norm_relu(tensor: Any) -> Any:
        return L.Activation("relu")(L.GroupNormalization(8)(tensor))

    hidden = norm_relu(L.Conv2D(16, 3, padding="same", use_bias=False)(inputs))
    for stage, width in enumerate((16, 32, 64)):
        strides = 2 if stage else 1
        shortcut = hidden
        if strides != 1:
            shortcut = L.Conv2D(width, 1, strides=strides, use_bias=False)(hidden)
        hidden = norm_relu(L.Conv2D(width, 3, strides, padding="same", use_bias=False)(hidden))
        hidden = L.GroupNormalization(8)(L.Conv2D(width, 3, padding="same", use_bias=False)(hidden))
        hidden = L.Activation("relu")(L.add([hidden, shortcut]))
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(hidden))
    return model_class(inputs, outputs, name="resnet")


ZOO: dict[str, Spec] = {
    "mlp": Spec(mlp, Images((784,)), "Dense(256, relu) x2, Dense(10) on 784 floats"),
    "cnn": Spec(
        cnn,
        Images((28, 28, 1)),
        "Conv2D(32, 3, relu) x2, Flatten, Dense(10) on 28x28x1 (no pooling)",
    ),
    "text": Spec(
        text,
        Tokens((32,), classes=2),
        "Embedding(1000, 64), Dense(64, relu), LayerNormalization, pooling, Dense(2) on 32 ids",
    ),
    "transformer": Spec(
        transformer,
        Tokens((32,), classes=2),
        "Embedding, MultiHeadAttention(4 x 16) block with feed-forward 128, Dense(2) on 32 ids",
    ),
    "mobilenet": Spec(
        mobilenet,
        Images((32, 32, 3)),
        "keras.applications.MobileNetV2(alpha=0.35), BatchNormalization frozen, on 32x32x3",
    ),
    "separable": Spec(
        separable,
        Images((32, 32, 3)),
        "SeparableConv2D residual blocks 32/64/128 + 256, GroupNormalization, on 32x32x3",
    ),
    "separable_jit": Spec(
        separable,
        Images((32, 32, 3)),
        "`separable`, plain and tracked steps compiled with XLA (jit_compile=True)",
        jit_compile=True,
    ),
    "autoencoder": Spec(
        autoencoder,
        Reconstruction((28, 28, 1)),
        "Conv2D(32) + pooling x2, Conv2DTranspose(32, strides 2) x2, Conv2D(1) on 28x28x1",
    ),
    "resnet": Spec(
        resnet,
        Images((32, 32, 3)),
        "ResNet-8 (basic blocks 16/32/64), GroupNormalization, on 32x32x3",
    ),
}


def build_compiled(name: str, model_class: type, steps_per_execution: int = 1) -> Any:
    """The named model built with `model_class` and compiled: Adam, its loss, its `jit_compile`."""
    spec = ZOO[name]
    model = spec.build(model_class)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=spec.data.loss(),
        jit_compile=spec.jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def synthetic_batches(name: str, batch_size: int, num_batches: int = 4) -> tuple[Any, Any]:
    """Inputs and targets of `num_batches` batches (numpy), the same on every call."""
    return ZOO[name].data.batches(batch_size * num_batches, np.random.default_rng(0))

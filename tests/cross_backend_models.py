"""The cases of the cross-backend test: small models with their data, optimizer and
logger, built the same way on either backend (no backend imports here).
tests/cross_backend_worker.py runs them, tests/test_cross_backend.py compares the logs.

Every case draws its data from its own generator and builds its model after
`keras.backend.clear_session()`, so layer names (the log's columns, the weight file's
paths) are the same in every process whatever ran before.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import layers
from keras_io_layers import TokenAndPositionEmbedding
from zoo_models import ZOO

import keras_gradtrack as kgt

BATCH, STEPS = 8, 3
EXAMPLES = BATCH * STEPS


@dataclasses.dataclass
class Run:
    """What one case fits: `model.fit(x, y, sample_weight=...)` with `logger`."""

    model: Any
    x: Any
    y: Any
    sample_weight: Any = None
    logger_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.05, momentum=0.9)


def adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


def classifier(inputs: Any, features: Any, optimizer: Callable[[], Any], classes: int = 3) -> Any:
    if len(features.shape) > 2:
        features = layers.Flatten()(features)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(classes, name="head")(features))
    model.compile(
        optimizer=optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def normal(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(EXAMPLES, *shape)).astype("float32")


def labels(seed: int, classes: int = 3) -> np.ndarray:
    return np.random.default_rng(seed + 1).integers(0, classes, EXAMPLES)


def mlp(optimizer: Callable[[], Any] = adam, **logger_options: Any) -> Run:
    inputs = keras.Input((12,))
    hidden = layers.Dense(16, activation="relu")(inputs)
    hidden = layers.Dense(16, activation="tanh")(hidden)
    model = classifier(inputs, hidden, optimizer)
    return Run(model, normal((12,), 1), labels(1), logger_options=logger_options)


def mlp_sample_weight() -> Run:
    run = mlp()
    run.sample_weight = np.random.default_rng(2).uniform(0.0, 2.0, EXAMPLES).astype("float32")
    return run


def mlp_example_ids() -> Run:
    run = mlp(sgd)
    ids = np.arange(EXAMPLES, dtype=np.int64) * 7 + 2**40
    run.x = {"features": run.x, "example_id": ids}
    return run


def cnn() -> Run:
    inputs = keras.Input((8, 8, 1))
    hidden = layers.Conv2D(4, 3, activation="relu")(inputs)
    hidden = layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")(hidden)
    return Run(classifier(inputs, hidden, sgd), normal((8, 8, 1), 3), labels(3))


def separable_cnn() -> Run:
    """Every convolution and normalization rule in one model."""
    inputs = keras.Input((8, 8, 2))
    hidden = layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    hidden = layers.GroupNormalization(2)(hidden)
    hidden = layers.SeparableConv2D(6, 3, strides=2, activation="relu")(hidden)
    hidden = layers.DepthwiseConv2D(2, depth_multiplier=2)(hidden)
    hidden = layers.LayerNormalization()(hidden)
    hidden = layers.Reshape((4, 12))(hidden)
    hidden = layers.Conv1D(4, 2, padding="causal")(hidden)
    hidden = layers.SeparableConv1D(4, 2, depth_multiplier=2)(hidden)
    hidden = layers.DepthwiseConv1D(2)(hidden)
    hidden = layers.RMSNormalization()(hidden)
    return Run(classifier(inputs, hidden, adam), normal((8, 8, 2), 4), labels(4))


def transformer_block() -> Run:
    inputs = keras.Input((6, 8))
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    hidden = layers.LayerNormalization()(inputs + attended)
    feed_forward = layers.Dense(16, activation="relu")(hidden)
    feed_forward = layers.Dense(8)(feed_forward)
    hidden = layers.LayerNormalization()(hidden + feed_forward)
    features = layers.GlobalAveragePooling1D()(hidden)
    # SGD: the attention's key bias has a gradient of exactly zero (the softmax ignores
    # it), rounding residue of either sign that Adam would scale up to steps of `lr`
    # times residue over epsilon, in both directions.
    return Run(classifier(inputs, features, sgd), normal((6, 8), 5), labels(5))


def token_and_position_embedding() -> Run:
    """keras-io's token and position tables (the position table's call does not depend
    on the batch), with repeated token ids."""
    inputs = keras.Input((6,), dtype="int32")
    features = layers.GlobalAveragePooling1D()(TokenAndPositionEmbedding(6, 10, 8)(inputs))
    tokens = np.random.default_rng(6).integers(0, 10, (EXAMPLES, 6)).astype("int32")
    return Run(classifier(inputs, features, sgd), tokens, labels(6))


def embedding_adam() -> Run:
    """Adam on an Embedding: plain Keras' own update differs by backend (on TensorFlow
    the gradient is an `IndexedSlices` and Adam's moments change only at its rows)."""
    inputs = keras.Input((5,), dtype="int32")
    features = layers.GlobalAveragePooling1D()(layers.Embedding(12, 6)(inputs))
    tokens = np.random.default_rng(14).integers(0, 12, (EXAMPLES, 5)).astype("int32")
    return Run(classifier(inputs, features, adam), tokens, labels(14))


def dropout_in_training() -> Run:
    inputs = keras.Input((12,))
    hidden = layers.Dense(16, activation="relu")(inputs)
    hidden = layers.Dropout(0.25, seed=3)(hidden)
    return Run(classifier(inputs, hidden, adam), normal((12,), 7), labels(7))


def several_inputs() -> Run:
    """Named inputs: token ids and features."""
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    features = keras.Input((4,), name="features")
    embedded = layers.GlobalAveragePooling1D()(layers.Embedding(12, 6)(tokens))
    hidden = layers.Dense(8, activation="relu")(layers.concatenate([embedded, features]))
    model = classifier({"tokens": tokens, "features": features}, hidden, sgd)
    rng = np.random.default_rng(8)
    x = {
        "tokens": rng.integers(0, 12, (EXAMPLES, 5)).astype("int32"),
        "features": rng.normal(size=(EXAMPLES, 4)).astype("float32"),
    }
    return Run(model, x, labels(8))


def several_outputs() -> Run:
    """Two outputs with their own losses and loss weights."""
    inputs = keras.Input((12,))
    hidden = layers.Dense(8, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(
        inputs,
        {
            "kind": layers.Dense(3, name="kind")(hidden),
            "size": layers.Dense(1, name="size")(hidden),
        },
    )
    model.compile(
        optimizer=sgd(),
        loss={
            "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "size": keras.losses.MeanSquaredError(),
        },
        loss_weights={"kind": 1.0, "size": 0.5},
    )
    y = {"kind": labels(12), "size": normal((1,), 13)}
    return Run(model, normal((12,), 12), y)


def lstm() -> Run:
    inputs = keras.Input((5,), dtype="int32")
    hidden = layers.LSTM(6)(layers.Embedding(10, 4)(inputs))
    tokens = np.random.default_rng(9).integers(0, 10, (EXAMPLES, 5)).astype("int32")
    # SGD: plain Keras' Adam updates an Embedding differently on each backend (`embedding_adam`).
    return Run(classifier(inputs, hidden, sgd), tokens, labels(9))


def stacked_cells() -> Run:
    """A recurrent layer off the recurrent rule (stacked LSTM and GRU cells, behind a
    `Masking`): the per-layer fallback on both backends."""
    inputs = keras.Input((5, 3))
    hidden = layers.RNN([layers.LSTMCell(4), layers.GRUCell(3)])(layers.Masking()(inputs))
    x = normal((5, 3), 14)
    x[::3, 3:] = 0.0  # every third example's last two steps masked
    return Run(classifier(inputs, hidden, sgd), x, labels(14))


def batch_normalization() -> Run:
    inputs = keras.Input((12,))
    hidden = layers.BatchNormalization()(layers.Dense(16)(inputs))
    run = Run(
        classifier(inputs, layers.Activation("relu")(hidden), sgd), normal((12,), 10), labels(10)
    )
    run.model.track_batch_normalization = True
    return run


def private() -> Run:
    """Clipping without noise (`noise_multiplier=0`): the update is deterministic."""
    run = mlp(sgd)
    run.model.make_private(l2_norm_clip=0.5, noise_multiplier=0.0)
    return run


def private_adaptive() -> Run:
    """Adaptive clipping without noise: each step's bound and update are deterministic."""
    run = mlp(sgd)
    clip = kgt.privacy.AdaptiveClip(target_quantile=0.5, learning_rate=0.2)
    run.model.make_private(l2_norm_clip=0.5, noise_multiplier=0.0, adaptive_clip=clip)
    return run


def private_loss_scale() -> Run:
    """Clipping without noise through a LossScaleOptimizer."""
    run = mlp(lambda: keras.optimizers.LossScaleOptimizer(sgd()))
    run.model.make_private(l2_norm_clip=0.5, noise_multiplier=0.0)
    return run


def attribution() -> Run:
    targets = (normal((12,), 11)[:4], labels(11)[:4])
    return mlp(sgd, targets=targets)


# The zoo (`zoo_models.py`: keras-io and Keras-guide models as their authors write them),
# but the guide's `train_step` written with `tf.GradientTape`.
ZOO_CASES = sorted(set(ZOO) - {"custom_train_step"})


def zoo(name: str) -> Run:
    """The zoo model `name` on `EXAMPLES` examples, without dropout (each backend draws
    its own masks), compiled as its author compiles it but with SGD (momentum) in place
    of Adam or RMSprop: those divide each gradient by its running magnitude, so where
    the exact gradient is 0 (a convolution's bias before BatchNormalization in
    training, a frozen base's cancelling sums) each backend's float32 rounding becomes
    an update of the learning rate's size, and plain Keras' own sparse update of an
    Embedding differs by backend (`embedding_adam`). Adam crosses in `mlp_adam`."""
    builder = ZOO[name]
    kwargs: dict[str, Any] = {"batch": EXAMPLES}
    if "dropout" in inspect.signature(builder).parameters:
        kwargs["dropout"] = 0.0
    found = builder(**kwargs)
    config = found.model.get_compile_config()
    config["optimizer"] = keras.optimizers.serialize(sgd())
    found.model.compile_from_config(config)
    return Run(found.model, found.x, found.y, found.sample_weight)


# name -> builder
CASES: dict[str, Callable[[], Run]] = {
    "mlp_sgd": lambda: mlp(sgd),
    "mlp_adam": mlp,
    "mlp_sample_weight": mlp_sample_weight,
    "mlp_example_ids": mlp_example_ids,
    "cnn": cnn,
    "separable_cnn": separable_cnn,
    "transformer_block": transformer_block,
    "token_and_position_embedding": token_and_position_embedding,
    "several_inputs": several_inputs,
    "embedding_adam": embedding_adam,
    "several_outputs": several_outputs,
    "dropout_in_training": dropout_in_training,
    "lstm": lstm,
    "stacked_cells": stacked_cells,
    "batch_normalization": batch_normalization,
    "private": private,
    "private_adaptive": private_adaptive,
    "private_loss_scale": private_loss_scale,
    "attribution": attribution,
    **{f"zoo_{name}": functools.partial(zoo, name) for name in ZOO_CASES},
}

# Cases whose model crosses as a whole (`model.save` to `.keras`, `keras.saving.load_model`
# on the other backend, with its compiled optimizer and loss) instead of as weights.
WHOLE_MODEL = ("mlp_adam",)

"""Small models written the way the Keras guides and keras-io examples write them.

Each builder copies its example's structure (layer choices, custom layers, how
the model is built and compiled); only the sizes are shrunk, and each comes
with synthetic data of the example's kind (no downloads). The dropout rates are
the examples' own by default; correctness tests pass `dropout=0.0`, since the
oracle's one-example forward passes draw other dropout masks than the batch.

BatchNormalization in training mode (the timeseries classifier) is tracked
through the batch statistics (`model.track_batch_normalization`): its oracle is
the full-batch one (`Zoo.full_batch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import layers
from keras_io_layers import TokenAndPositionEmbedding

import keras_gradtrack as kgt


@dataclasses.dataclass
class Zoo:
    """A model of the zoo with a batch of its data.

    Attributes:
        model: The compiled model.
        x: Inputs (numpy, any structure).
        y: Targets.
        sample_weight: Per-example weights, or None.
        full_batch: Whether the oracle is the full-batch one (examples coupled by
            BatchNormalization in training mode).
    """

    model: Any
    x: Any
    y: Any
    sample_weight: Any = None
    full_batch: bool = False


# -- keras-io text_classification_with_transformer ---------------------------------


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


def transformer_classifier(batch: int = 6, maxlen: int = 6, dropout: float = 0.1) -> Zoo:
    """`maxlen` equal to the batch size by default: the position table's call then
    looks like a batch of its own to static shapes."""
    vocab_size, embed_dim, num_heads, ff_dim = 20, 8, 2, 8
    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim, rate=dropout)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(dropout)(x)
    x = layers.Dense(6, activation="relu")(x)
    x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = kgt.GradientTrackingModel(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(7)
    x_data = rng.integers(0, vocab_size, (batch, maxlen))
    return Zoo(model, x_data, rng.integers(0, 2, batch))


# -- keras-io mnist_convnet --------------------------------------------------------


def mnist_convnet(batch: int = 6, dropout: float = 0.5) -> Zoo:
    num_classes, input_shape = 5, (12, 12, 1)
    model = kgt.GradientTrackingSequential(
        [
            keras.Input(shape=input_shape),
            layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(6, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(dropout),
            layers.Dense(num_classes, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    rng = np.random.default_rng(7)
    x = rng.uniform(0.0, 1.0, (batch, *input_shape)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, num_classes, batch), num_classes)
    return Zoo(model, x, y)


# -- Keras guide "Transfer learning & fine-tuning" ------------------------------------


def transfer_learning(batch: int = 4, dropout: float = 0.2) -> Zoo:
    """MobileNetV2 (alpha 0.35, 32x32, weights=None: no download) as the frozen base."""
    base_model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35, include_top=False
    )
    base_model.trainable = False
    inputs = keras.Input(shape=(32, 32, 3))
    scale_layer = layers.Rescaling(scale=1 / 127.5, offset=-1)
    x = scale_layer(inputs)
    # The base runs in inference mode, so its BatchNormalization layers do too.
    x = base_model(x, training=False)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(1)(x)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy()],
    )
    rng = np.random.default_rng(7)
    x_data = rng.uniform(0.0, 255.0, (batch, 32, 32, 3)).astype("float32")
    return Zoo(model, x_data, rng.integers(0, 2, (batch, 1)).astype("float32"))


# -- keras-io autoencoder (convolutional autoencoder for image denoising) ----------


def conv_autoencoder(batch: int = 6) -> Zoo:
    input = layers.Input(shape=(8, 8, 1))
    # Encoder
    x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(input)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(x)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    # Decoder
    x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    autoencoder = kgt.GradientTrackingModel(input, x)
    autoencoder.compile(optimizer="adam", loss="binary_crossentropy")
    rng = np.random.default_rng(7)
    clean = rng.uniform(0.0, 1.0, (batch, 8, 8, 1)).astype("float32")
    noisy = np.clip(clean + 0.4 * rng.normal(size=clean.shape), 0.0, 1.0).astype("float32")
    return Zoo(autoencoder, noisy, clean)


# -- Keras functional API guide: the ticket classifier ---------------------------------


def ticket_classifier(batch: int = 6) -> Zoo:
    num_tags, num_words, num_departments = 12, 40, 4
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(num_tags,), name="tags")
    title_features = layers.Embedding(num_words, 8)(title_input)
    body_features = layers.Embedding(num_words, 6)(body_input)
    title_features = layers.LSTM(8)(title_features)
    body_features = layers.LSTM(4)(body_features)
    x = layers.concatenate([title_features, body_features, tags_input])
    priority_pred = layers.Dense(1, name="priority")(x)
    department_pred = layers.Dense(num_departments, name="department")(x)
    model = kgt.GradientTrackingModel(
        inputs=[title_input, body_input, tags_input],
        outputs={"priority": priority_pred, "department": department_pred},
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={
            "priority": keras.losses.BinaryCrossentropy(from_logits=True),
            "department": keras.losses.CategoricalCrossentropy(from_logits=True),
        },
        loss_weights={"priority": 1.0, "department": 0.2},
    )
    rng = np.random.default_rng(7)
    x = {
        "title": rng.integers(0, num_words, (batch, 7)),
        "body": rng.integers(0, num_words, (batch, 15)),
        "tags": rng.integers(0, 2, (batch, num_tags)).astype("float32"),
    }
    y = {
        "priority": rng.random((batch, 1)).astype("float32"),
        "department": keras.utils.to_categorical(
            rng.integers(0, num_departments, batch), num_departments
        ),
    }
    return Zoo(model, x, y)


# -- Keras guide "Customizing what happens in fit()" (TensorFlow) --------------------


class CustomModel(kgt.GradientTrackingModel):
    def train_step(self, data):
        import tensorflow as tf  # the guide's step is TensorFlow's (the zoo builds on JAX too)

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            # Compute the loss value (the loss function is configured in `compile()`)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        # Compute gradients: `tracked_gradient` in place of `tape.gradient`
        trainable_vars = self.trainable_variables
        gradients = self.tracked_gradient(tape, loss, trainable_vars)
        # Update weights
        self.optimizer.apply(gradients, trainable_vars)
        # Update metrics (includes the metric that tracks the loss)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        # Return a dict mapping metric names to current value
        return {m.name: m.result() for m in self.metrics}


def custom_train_step(batch: int = 6) -> Zoo:
    """The guide's model with a hidden layer added, so there are two columns."""
    inputs = keras.Input(shape=(32,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(7)
    x = rng.random((batch, 32)).astype("float32")
    return Zoo(model, x, rng.random((batch, 1)).astype("float32"))


# -- keras-io image_classification_from_scratch (GroupNormalization for BN) ---------


def separable_residual_classifier(batch: int = 4, dropout: float = 0.25) -> Zoo:
    """The example's Xception-like network with `jit_compile=True`, GroupNormalization
    in place of BatchNormalization, and small widths."""

    def normalization() -> layers.Layer:
        return layers.GroupNormalization(groups=2)

    def make_model(input_shape: tuple[int, ...], num_classes: int) -> Any:
        inputs = keras.Input(shape=input_shape)
        # Entry block
        x = layers.Rescaling(1.0 / 255)(inputs)
        x = layers.Conv2D(8, 3, strides=2, padding="same")(x)
        x = normalization()(x)
        x = layers.Activation("relu")(x)
        previous_block_activation = x  # Set aside residual
        for size in [8]:
            x = layers.Activation("relu")(x)
            x = layers.SeparableConv2D(size, 3, padding="same")(x)
            x = normalization()(x)
            x = layers.Activation("relu")(x)
            x = layers.SeparableConv2D(size, 3, padding="same")(x)
            x = normalization()(x)
            x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
            # Project residual
            residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
            x = layers.add([x, residual])  # Add back residual
            previous_block_activation = x  # Set aside next residual
        x = layers.SeparableConv2D(16, 3, padding="same")(x)
        x = normalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.GlobalAveragePooling2D()(x)
        units = 1 if num_classes == 2 else num_classes
        x = layers.Dropout(dropout)(x)
        # We specify activation=None so as to return logits
        outputs = layers.Dense(units, activation=None)(x)
        return kgt.GradientTrackingModel(inputs, outputs)

    model = make_model(input_shape=(8, 8, 3), num_classes=2)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-4),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(name="acc")],
        jit_compile=True,
    )
    rng = np.random.default_rng(7)
    x = rng.uniform(0.0, 255.0, (batch, 8, 8, 3)).astype("float32")
    return Zoo(model, x, rng.integers(0, 2, (batch, 1)).astype("float32"))


# -- keras-io text_classification_from_scratch ------------------------------------


def conv1d_text_classifier(batch: int = 6, dropout: float = 0.5) -> Zoo:
    max_features, embedding_dim, sequence_length = 50, 8, 40
    # A integer input for vocab indices.
    inputs = keras.Input(shape=(None,), dtype="int64")
    # Next, we add a layer to map those vocab indices into a space of dimensionality
    # 'embedding_dim'.
    x = layers.Embedding(max_features, embedding_dim)(inputs)
    x = layers.Dropout(dropout)(x)
    # Conv1D + global max pooling
    x = layers.Conv1D(8, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.Conv1D(8, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.GlobalMaxPooling1D()(x)
    # We add a vanilla hidden layer:
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(dropout)(x)
    # We project onto a single unit output layer, and squash it with a sigmoid:
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = kgt.GradientTrackingModel(inputs, predictions)
    # Compile the model with binary crossentropy loss and an adam optimizer.
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    rng = np.random.default_rng(7)
    x_data = rng.integers(0, max_features, (batch, sequence_length))
    return Zoo(model, x_data, rng.integers(0, 2, (batch, 1)).astype("float32"))


# -- keras-io bidirectional_lstm_imdb -------------------------------------------------


def bidirectional_lstm(batch: int = 6, max_features: int = 50) -> Zoo:
    # Input for variable-length sequences of integers
    inputs = keras.Input(shape=(None,), dtype="int32")
    # Embed each integer in a 8-dimensional vector
    x = layers.Embedding(max_features, 8)(inputs)
    # Add 2 bidirectional LSTMs
    x = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(4))(x)
    # Add a classifier
    outputs = layers.Dense(1, activation="sigmoid")(x)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(7)
    x_data = rng.integers(1, max_features, (batch, 9))
    return Zoo(model, x_data, rng.integers(0, 2, (batch, 1)).astype("float32"))


# -- keras-io timeseries_weather_forecasting -------------------------------------------


def lstm_forecasting(batch: int = 6) -> Zoo:
    sequence_length, features = 12, 7
    inputs = keras.layers.Input(shape=(sequence_length, features))
    lstm_out = keras.layers.LSTM(8)(inputs)
    outputs = keras.layers.Dense(1)(lstm_out)
    model = kgt.GradientTrackingModel(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batch, sequence_length, features)).astype("float32")
    return Zoo(model, x, rng.normal(size=(batch, 1)).astype("float32"))


# -- keras-io timeseries_classification_from_scratch ------------------------------------


def timeseries_classifier(batch: int = 6) -> Zoo:
    """Conv1D + BatchNormalization blocks, BatchNormalization training (opted in)."""
    input_shape, num_classes = (16, 1), 2
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)
    model = kgt.GradientTrackingModel(inputs=input_layer, outputs=output_layer)
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    model.track_batch_normalization = True
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batch, *input_shape)).astype("float32")
    return Zoo(model, x, rng.integers(0, num_classes, batch), full_batch=True)


ZOO: dict[str, Callable[..., Zoo]] = {
    "mnist_convnet": mnist_convnet,
    "transformer_classifier": transformer_classifier,
    "transfer_learning": transfer_learning,
    "conv_autoencoder": conv_autoencoder,
    "ticket_classifier": ticket_classifier,
    "custom_train_step": custom_train_step,
    "separable_residual_classifier": separable_residual_classifier,
    "conv1d_text_classifier": conv1d_text_classifier,
    "bidirectional_lstm": bidirectional_lstm,
    "lstm_forecasting": lstm_forecasting,
    "timeseries_classifier": timeseries_classifier,
}

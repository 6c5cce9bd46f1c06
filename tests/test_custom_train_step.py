"""A model's own `train_step` always runs; `tracked_gradient` gives its statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_from_losses, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(31)
X = rng.normal(size=(16, 6)).astype("float32")
Y = rng.integers(0, 3, 16)


def logged_step(path: Path, step: int = 0) -> dict[str, Any]:
    """Every logged statistic of one tracked step."""
    with kgt.GradientLog(path) as log:
        rows = log.per_example("step") == step
        logged = {name: log.per_example(name)[rows] for name in log.per_example_names}
        logged["example_id"] = log.per_example("example_id")[rows]
        position = list(log.per_step("step")).index(step)
        logged.update({name: log.per_step(name)[position] for name in log.per_step_names})
    return logged


class TrainerPattern(kgt.GradientTrackingMixin, keras.Model):
    """The train_step of the Keras guide "Customizing what happens in fit()", with
    `tracked_gradient` in place of `tape.gradient`; it counts the steps it runs."""

    def __init__(self, use_tracked_gradient: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)
        self.use_tracked_gradient = use_tracked_gradient
        self.steps_run = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))

    def train_step(self, data: Any) -> Any:
        x, y = data
        self.steps_run.assign_add(1.0)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        if self.use_tracked_gradient:
            gradients = self.tracked_gradient(tape, loss, trainable_vars)
        else:
            gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def trainer(**kwargs: Any) -> TrainerPattern:
    model = TrainerPattern(**kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model(X[:2])
    return model


def test_the_trainer_pattern_logs_exact_statistics(tmp_path: Path) -> None:
    model = trainer()
    expected = oracle_statistics(model, X, Y)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
    assert float(model.steps_run) == 1.0
    assert_matches_oracle(logged_step(tmp_path / "run.h5"), expected)


def test_the_users_step_runs_on_every_step_tracked_or_not(tmp_path: Path) -> None:
    model = trainer()
    plain = trainer()
    plain.set_weights(model.get_weights())
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", every_n_steps=3)
    model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[logger])
    plain.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert float(model.steps_run) == 8.0
    for tracked, untracked in zip(model.trainable_weights, plain.trainable_weights):
        np.testing.assert_allclose(tracked.numpy(), untracked.numpy(), rtol=1e-5, atol=1e-6)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.per_step("step").tolist() == [0, 3, 6]


class ZeroUpdate(TrainerPattern):
    """Applies zero gradients: the weights must not move, tracked or not."""

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        gradients = self.tracked_gradient(tape, loss, self.trainable_variables)
        self.optimizer.apply([tf.zeros_like(g) for g in gradients], self.trainable_variables)
        return {"loss": loss}


def test_a_step_that_applies_zero_gradients_keeps_its_weights(tmp_path: Path) -> None:
    model = ZeroUpdate()
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss="mse")
    model(X[:2])
    before = [w.numpy().copy() for w in model.trainable_weights]
    y = rng.normal(size=(16, 3)).astype("float32")
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(X, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
    for old, variable in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(old, variable.numpy())
    assert kgt.GradientLog(tmp_path / "run.h5").num_steps == 2


def test_a_step_without_tracked_gradient_is_refused_before_any_update(tmp_path: Path) -> None:
    model = trainer(use_tracked_gradient=False)
    before = [w.numpy().copy() for w in model.trainable_weights]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError, match=r"did not call `self.tracked_gradient\(tape, loss"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
    for old, variable in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(old, variable.numpy())
    # Untracked, the same model trains as written.
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert not np.array_equal(before[0], model.trainable_weights[0].numpy())


class VAE(kgt.GradientTrackingMixin, keras.Model):
    """A variational autoencoder's loss (reconstruction + KL), the latent mean as code."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = keras.layers.Dense(4, activation="tanh", name="encoder")
        self.z_mean = keras.layers.Dense(2, name="z_mean")
        self.z_log_var = keras.layers.Dense(2, name="z_log_var")
        self.decoder = keras.layers.Dense(6, name="decoder")

    def call(self, x: Any) -> Any:
        return self.per_example_loss(x)

    def per_example_loss(self, x: Any) -> Any:
        h = self.encoder(x)
        mean, log_var = self.z_mean(h), self.z_log_var(h)
        reconstruction = tf.reduce_sum(tf.square(x - self.decoder(mean)), axis=1)
        kl = -0.5 * tf.reduce_sum(1 + log_var - tf.square(mean) - tf.exp(log_var), axis=1)
        return reconstruction + kl

    def train_step(self, x: Any) -> Any:
        with tf.GradientTape() as tape:
            per_example = self.per_example_loss(x)
            loss = tf.reduce_mean(per_example)
        grads = self.tracked_gradient(
            tape, loss, self.trainable_weights, per_example_loss=per_example
        )
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


def test_a_vae_step_with_per_example_losses_is_exact(tmp_path: Path) -> None:
    model = VAE()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model(X[:2])
    expected = oracle_from_losses(model, lambda m, x: m.per_example_loss(x), X)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(X, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
    assert_matches_oracle(logged_step(tmp_path / "run.h5"), expected)


class GAN(kgt.GradientTrackingMixin, keras.Model):
    """A GAN step: the generator's gradient tracked (one row per latent sample), the
    discriminator's taken with `tape.gradient`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.generator = keras.Sequential(
            [keras.layers.Dense(5, activation="relu"), keras.layers.Dense(6)], name="generator"
        )
        self.discriminator = keras.Sequential(
            [keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)],
            name="discriminator",
        )
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, z: Any) -> Any:
        return self.discriminator(self.generator(z))

    def compile(self, **kwargs: Any) -> None:
        super().compile(**kwargs)
        self.d_optimizer = keras.optimizers.SGD(0.1)
        self.g_optimizer = keras.optimizers.SGD(0.1)

    def generator_losses(self, z: Any) -> Any:
        logits = self.discriminator(self.generator(z))
        return keras.losses.binary_crossentropy(tf.ones_like(logits), logits, from_logits=True)

    def train_step(self, data: Any) -> Any:
        z, real = data["z"], data["real"]
        g_vars = self.generator.trainable_weights
        with tf.GradientTape() as tape:
            g_losses = self.generator_losses(z)
            g_loss = tf.reduce_mean(g_losses)
        g_grads = self.tracked_gradient(tape, g_loss, g_vars, per_example_loss=g_losses)
        self.g_optimizer.apply_gradients(zip(g_grads, g_vars))
        fake = self.generator(z)
        images = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.zeros([tf.shape(z)[0], 1]), tf.ones([tf.shape(z)[0], 1])], 0)
        d_vars = self.discriminator.trainable_weights
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, d_vars), d_vars))
        return {"g_loss": g_loss, "d_loss": d_loss}


def test_a_gan_step_tracks_the_generator_and_leaves_the_other_columns_nan(
    tmp_path: Path,
) -> None:
    model = GAN()
    model.compile()
    z = rng.normal(size=(8, 3)).astype("float32")
    real = rng.normal(size=(8, 6)).astype("float32")
    model(z[:2])
    generator_vars = model.generator.trainable_weights
    expected = oracle_from_losses(model, lambda m, x: m.generator_losses(x), z, generator_vars)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    data = {"z": z, "real": real, "example_id": np.arange(100, 108)}
    model.fit(data, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
    logged = logged_step(tmp_path / "run.h5")
    columns = [model.tracked_layer_names.index(name) for name in expected["layers"]]
    others = [k for k in range(len(model.tracked_layer_names)) if k not in columns]
    assert len(columns) == 2 and len(others) == 2
    for name in ("layer_grad_norm", "layer_cosine"):
        assert np.isnan(logged[name][:, others]).all()
        logged[name] = logged[name][:, columns]
    np.testing.assert_array_equal(logged.pop("example_id"), np.arange(100, 108))
    assert_matches_oracle(logged, expected)


def test_tracked_gradient_twice_in_one_step_is_refused(tmp_path: Path) -> None:
    class Twice(TrainerPattern):
        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape(persistent=True) as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.tracked_gradient(tape, loss, self.trainable_variables)
            self.tracked_gradient(tape, loss, self.trainable_variables)
            return {"loss": loss}

    model = Twice()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy())
    model(X[:2])
    with pytest.raises(ValueError, match="called twice in one step"):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "r.h5")])

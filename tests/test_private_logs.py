"""What a gradient log of a private fit holds: rows keyed by the ids that travel through
`poisson_batches`; statistics of the unclipped, noise-free batch gradient."""

from __future__ import annotations

from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradtrack as kgt


def test_a_fit_on_poisson_batches_with_ids_logs_the_datasets_ids(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n, q, steps, epochs = 60, 0.2, 4, 2
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, n)
    ids = 1000 + 7 * np.arange(n)  # not positions
    model = kgt.GradientTrackingSequential(
        [keras.Input((5,), name="features"), keras.layers.Dense(3)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    # A learning rate of 0 keeps the weights: each row's loss is its example's own.
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=q * n)
    batches = kgt.privacy.poisson_batches(
        {"features": x, "example_id": ids}, y, sampling_rate=q, steps=steps, seed=3
    )
    path = tmp_path / "private.h5"
    logger = kgt.HDF5GradientLogger(path)
    model.fit(batches, epochs=epochs, shuffle=False, verbose=0, callbacks=[logger])

    # Keras takes a batch of one pass before training (to build the model and check
    # that examples do not mix): the epochs draw the passes after it.
    drawn = [
        indices
        for epoch in range(1, epochs + 1)
        for indices in kgt.privacy.poisson_batch_indices(n, q, steps, seed=[3, epoch])
    ]
    with h5py.File(path, "r") as file:
        logged_ids = file["per_example/example_id"][:]
        logged_loss = file["per_example/loss"][:]
    np.testing.assert_array_equal(logged_ids, ids[np.concatenate(drawn)])
    positions = (logged_ids - 1000) // 7
    own_loss = loss(y[positions], model.predict(x[positions], verbose=0))
    np.testing.assert_allclose(logged_loss, own_loss, rtol=1e-4)


@pytest.mark.parametrize("noise_multiplier", [0.0, 1.0])
def test_a_private_steps_statistics_are_of_the_unclipped_mean(
    tmp_path: Path, noise_multiplier: float
) -> None:
    """`cosine` and `batch_grad_norm` are against `(1/B) sum_i g_i` of the unclipped
    per-example gradients: neither the clipped sum nor the noisy gradient the optimizer
    receives (which the weights' change shows, with SGD at rate 1)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.integers(0, 3, 16)
    keras.utils.set_random_seed(0)
    model = kgt.GradientTrackingSequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    clip = 0.5
    model.make_private(l2_norm_clip=clip, noise_multiplier=noise_multiplier)
    before = [w.numpy().copy() for w in model.trainable_weights]
    per_example = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            example_loss = model.loss(y[i : i + 1], model(x[i : i + 1]))
        gradients = tape.gradient(example_loss, model.trainable_weights)
        per_example.append(np.concatenate([g.numpy().ravel() for g in gradients]))
    g = np.array(per_example, dtype=np.float64)
    path = tmp_path / "private.h5"
    logger = kgt.HDF5GradientLogger(path)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[logger])

    norms = np.linalg.norm(g, axis=1)
    mean = g.mean(axis=0)
    received = np.concatenate(
        [(b - a.numpy()).ravel() for b, a in zip(before, model.trainable_weights)]
    )
    clipped_mean = (g * np.minimum(1.0, clip / norms)[:, None]).mean(axis=0)
    with h5py.File(path, "r") as file:
        cosine = file["per_example/cosine"][:]
        batch_grad_norm = file["per_step/batch_grad_norm"][0]
        np.testing.assert_allclose(file["per_example/grad_norm"][:], norms, rtol=1e-4)
        np.testing.assert_allclose(file["per_example/dp_grad_norm"][:], norms, rtol=1e-4)
    np.testing.assert_allclose(cosine, g @ mean / (norms * np.linalg.norm(mean)), rtol=1e-4)
    np.testing.assert_allclose(batch_grad_norm, np.linalg.norm(mean), rtol=1e-4)
    # What the optimizer received is another vector: the clipped mean (plus the noise).
    assert norms.max() > clip
    assert not np.allclose(np.linalg.norm(received), np.linalg.norm(mean), rtol=0.05)
    if noise_multiplier == 0:
        np.testing.assert_allclose(received, clipped_mean, rtol=1e-4, atol=1e-6)

"""keras-io's knowledge distillation example, as written there (Keras 3 version).

`Distiller` overrides `compute_loss(self, x=None, y=None, y_pred=None,
sample_weight=None, allow_empty=False)` (no `training` argument, which Keras'
trainer allows) and `call`, and is compiled without `loss`. Source: keras-io,
examples/vision/knowledge_distillation.py; `keras.Model` is
`kgt.GradientTrackingModel` here, and the teacher and student are the example's
CNNs with fewer filters. Both backends' tests train it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
from keras import layers, ops

import keras_gradtrack as kgt


class Distiller(kgt.GradientTrackingModel):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer,
        metrics,
        student_loss_fn,
        distillation_loss_fn,
        alpha=0.1,
        temperature=3,
    ):
        """Configure the distiller.

        Args:
            optimizer: Keras optimizer for the student weights
            metrics: Keras metrics for evaluation
            student_loss_fn: Loss function of difference between student
                predictions and ground-truth
            distillation_loss_fn: Loss function of difference between soft
                student predictions and soft teacher predictions
            alpha: weight to student_loss_fn and 1-alpha to distillation_loss_fn
            temperature: Temperature for softening probability distributions.
                Larger temperature gives softer distributions.
        """
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)

        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)

        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss

    def call(self, x):
        return self.student(x)


def cnn(name: str, filters: tuple[int, int]) -> keras.Model:
    """The example's teacher (256, 512 filters) and student (16, 32), smaller."""
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(filters[0], (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(filters[1], (3, 3), strides=(2, 2), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ],
        name=name,
    )


def distiller() -> Distiller:
    model = Distiller(student=cnn("student", (4, 8)), teacher=cnn("teacher", (8, 16)))
    model.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )
    return model


def mnist_shaped(n: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(7)
    return rng.uniform(size=(n, 28, 28, 1)).astype("float32"), rng.integers(0, 10, n)


def expected_losses(model: Distiller, x: Any, y: Any) -> np.ndarray:
    """`l_i`: the example's loss (the terms of the batch loss, unreduced), in float64."""
    teacher = np.asarray(model.teacher(x, training=False), np.float64)
    student = np.asarray(model.student(x, training=False), np.float64)

    def softmax(logits: np.ndarray) -> np.ndarray:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    cross_entropy = -np.log(softmax(student)[np.arange(len(y)), y])
    p = np.clip(softmax(teacher / model.temperature), 1e-7, 1)
    q = np.clip(softmax(student / model.temperature), 1e-7, 1)
    divergence = np.sum(p * np.log(p / q), axis=1) * model.temperature**2
    return model.alpha * cross_entropy + (1 - model.alpha) * divergence


def assert_logs_every_example(path: Path) -> None:
    """Two epochs of 40 examples in batches of 16, logged to `path`: a row per
    example, the first batch's losses `expected_losses`, every row finite."""
    x, y = mnist_shaped(40)
    model = distiller()
    model(x[:1])
    first_losses = expected_losses(model, x[:16], y[:16])
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path)],
    )
    assert len(history.history["loss"]) == 2
    with kgt.GradientLog(path) as log:
        assert log.per_step("batch_size").tolist() == [16, 16, 8] * 2
        losses = log.per_example("loss")
        assert losses.shape == (80,)
        np.testing.assert_allclose(losses[:16], first_losses, rtol=1e-4)
        assert np.all(np.isfinite(losses))
        assert np.all(np.isfinite(log.per_example("grad_norm")))

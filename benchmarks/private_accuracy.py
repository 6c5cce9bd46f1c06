"""Accuracy of private training (DP-SGD) at epsilon 1, 3 and 8 beside non-private training.

Two small tasks that run on a laptop CPU in a minute or two:

* `digits`: scikit-learn's 8x8 digits (1797 images, 10 classes), 1500 to train, the
  rest to test; an MLP (Dense 64 relu, Dense 10).
* `keywords`: a synthetic text task (sequences of 20 token ids of 200 holding two
  keywords of the label's set and one of the other's), 4000 to train, 1000 to test;
  Embedding(200, 16), mean over positions, Dense(2).

Private runs: Poisson-sampled batches (`kgt.privacy.poisson_batches`, expected size 64),
`C = 1`, SGD, the noise multiplier that `kgt.privacy.compute_noise_multiplier` gives for
the target epsilon at delta 1e-5 (RDP accountant); the epsilon reached is recomputed from
the steps taken. Non-private: the same model, data and optimizer without `make_private`.

```
python benchmarks/private_accuracy.py                  # both tasks, epsilon 1, 3, 8
python benchmarks/private_accuracy.py --tasks digits --epochs 10
```
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

from typing import Any

import keras
import numpy as np

import keras_gradtrack as kgt

DELTA = 1e-5
EXPECTED_BATCH = 64
CLIP = 1.0


def digits() -> tuple[Any, Any, Any, Any, Any]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]

    def model() -> Any:
        return kgt.GradientTrackingSequential(
            [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
        )

    return x[:1500], y[:1500], x[1500:], y[1500:], model


def keywords() -> tuple[Any, Any, Any, Any, Any]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 5000)
    x = rng.integers(10, 200, size=(5000, 20))
    keyword_sets = (np.arange(0, 5), np.arange(5, 10))
    for row, label in zip(x, y):
        # two keywords of the label's set, one of the other's, at random positions
        positions = rng.choice(20, 3, replace=False)
        row[positions[:2]] = rng.choice(keyword_sets[label], 2)
        row[positions[2]] = rng.choice(keyword_sets[1 - label])

    def model() -> Any:
        return kgt.GradientTrackingSequential(
            [
                keras.Input((20,), dtype="int32"),
                keras.layers.Embedding(200, 16),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(2),
            ]
        )

    return x[:4000], y[:4000], x[4000:], y[4000:], model


TASKS = {"digits": digits, "keywords": keywords}


def train(
    task: str, epochs: int, epsilon: float | None, learning_rate: float
) -> tuple[float, float]:
    """Test accuracy and the epsilon spent (inf without privacy)."""
    x, y, x_test, y_test, build = TASKS[task]()
    keras.utils.set_random_seed(0)
    model = build()
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    q = EXPECTED_BATCH / len(x)
    steps_per_epoch = round(1 / q)
    spent = float("inf")
    if epsilon is None:
        model.fit(x, y, batch_size=EXPECTED_BATCH, epochs=epochs, verbose=0)
    else:
        steps = epochs * steps_per_epoch
        sigma = kgt.privacy.compute_noise_multiplier(epsilon, q, steps, DELTA)
        model.make_private(
            l2_norm_clip=CLIP, noise_multiplier=sigma, expected_batch_size=q * len(x)
        )
        batches = kgt.privacy.poisson_batches(x, y, sampling_rate=q, steps=steps_per_epoch, seed=0)
        model.fit(batches, epochs=epochs, verbose=0, shuffle=False)
        spent = kgt.privacy.compute_epsilon(sigma, q, model.private_steps, DELTA)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return float(accuracy), spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="digits,keywords")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--epsilons", default="1,3,8")
    parser.add_argument("--learning-rate", type=float, default=0.5)
    args = parser.parse_args()
    rows = [
        "| task | training | epsilon spent (delta 1e-5) | test accuracy |",
        "| --- | --- | --- | --- |",
    ]
    for task in args.tasks.split(","):
        accuracy, _ = train(task, args.epochs, None, args.learning_rate / 10)
        rows.append(f"| {task} | non-private | - | {accuracy:.3f} |")
        print(rows[-1], flush=True)
        for epsilon in (float(e) for e in args.epsilons.split(",")):
            accuracy, spent = train(task, args.epochs, epsilon, args.learning_rate)
            rows.append(
                f"| {task} | DP-SGD, target epsilon {epsilon:g} | {spent:.2f} | {accuracy:.3f} |"
            )
            print(rows[-1], flush=True)
    print(f"\n{args.epochs} epochs, expected batch {EXPECTED_BATCH}, C={CLIP}\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

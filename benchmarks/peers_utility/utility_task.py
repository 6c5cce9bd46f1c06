"""The task every driver of `benchmarks/private_utility.py` trains: its data, its
hyperparameters and the JSON line each driver prints per seed (numpy and scikit-learn
only, so that every tool's virtualenv can import it).

scikit-learn's 8x8 digits (1797 images, 10 classes), a fixed split of 1408 to train and
389 to test (one permutation by numpy's legacy `RandomState(0)`, the same in every numpy),
standardized by the training set's mean and standard deviation. 1408 = 22 x 64: a sampling
rate of exactly 1/22 (expected batch 64), 22 steps an epoch, and fixed batches of exactly
64 for the tool that takes fixed batches.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import numpy as np

TRAIN = 1408
BATCH = 64  # expected batch size (Poisson) or fixed batch size
CLIP = 1.0
NOISE = 1.1
DELTA = 1e-5
EPOCHS = 30
LEARNING_RATE = 0.5  # plain SGD, no momentum
HIDDEN = 128
STEPS_PER_EPOCH = TRAIN // BATCH
SAMPLING_RATE = BATCH / TRAIN


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): float32 features, int64 labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order].astype("float64"), y[order].astype("int64")
    x_train, x_test = x[:TRAIN], x[TRAIN:]
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # pixels that are 0 in every training image
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return x_train.astype("float32"), y[:TRAIN], x_test.astype("float32"), y[TRAIN:]


def arguments(description: str) -> argparse.Namespace:
    """The flags every driver takes (defaults: the task above)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--noise-multiplier", type=float, default=NOISE)
    return parser.parse_args()


def seeds(args: argparse.Namespace) -> list[int]:
    return [int(seed) for seed in args.seeds.split(",") if seed.strip()]


def classifier_layers(keras: Any) -> list[Any]:
    """The model every Keras driver trains, built from its `keras` module (Keras 3 or
    `tf.keras`): 64 inputs, a ReLU layer of HIDDEN units, 10 logits (Glorot uniform
    weights, zero biases, Keras' defaults)."""
    return [
        keras.Input((64,)),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(10),
    ]


def main(description: str, run: Callable[[int, argparse.Namespace], dict[str, Any]]) -> None:
    """Parses the flags and trains each seed: `run(seed, args)` returns the seed's
    result (`emit`'s `tool`, `accuracy`, `epsilon`, `steps`, `seconds` and extra fields),
    printed as one JSON line."""
    args = arguments(description)
    for seed in seeds(args):
        emit(seed=seed, args=args, **run(seed, args))


def emit(
    tool: str,
    seed: int,
    accuracy: float,
    epsilon: float,
    steps: int,
    seconds: float,
    args: argparse.Namespace,
    **extra: Any,
) -> None:
    """Print one seed's result as one JSON line (what the runner reads)."""
    row = {
        "tool": tool,
        "seed": seed,
        "accuracy": float(accuracy),
        "epsilon": float(epsilon),
        "steps": int(steps),
        "seconds": float(seconds),
        "epochs": args.epochs,
        "noise_multiplier": args.noise_multiplier,
        "sampling_rate": SAMPLING_RATE,
        "delta": DELTA,
        **extra,
    }
    print(json.dumps(row), flush=True)

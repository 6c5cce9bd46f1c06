"""`python -m keras_gradtrack.demo`: train on scikit-learn's bundled digits, log, summarize.

A fraction of the training labels is flipped on purpose. The model is trained
with example ids and `HDF5GradientLogger`; the summary read back from the log
shows the per-step statistics and ranks examples by self-influence (the sum
over logged steps of their squared gradient norm, as in TracIn): the top of
that ranking is mostly the flipped labels.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def load_digits_with_flipped_labels(
    flip_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Digits scaled to [0, 1], labels with `flip_fraction` changed, and the flipped mask."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    rng = np.random.default_rng(seed)
    flipped = rng.random(len(y)) < flip_fraction
    y = y.copy()
    y[flipped] = (y[flipped] + rng.integers(1, 10, flipped.sum())) % 10
    return x, y, flipped


def build_model():  # type: ignore[no-untyped-def]
    import keras

    import keras_gradtrack as kgt

    inputs = keras.Input((64,), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu", name="hidden_1")(inputs)
    hidden = keras.layers.Dense(32, activation="relu", name="hidden_2")(hidden)
    outputs = keras.layers.Dense(10, name="logits")(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs, name="digits_mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def summarize(path: Path, flipped: np.ndarray) -> str:
    """A plain-text summary of the log, read back with `GradientLog`."""
    import keras_gradtrack as kgt

    lines = []
    with kgt.GradientLog(path) as log:
        lines.append(repr(log))
        lines.append(f"layers: {', '.join(log.layers)}")
        epochs = log.per_step("epoch")
        lines.append("epoch  steps  mean_cosine  frac_negative  grad_diversity  noise_scale")
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            lines.append(
                f"{epoch:5d}  {rows.sum():5d}  {np.nanmean(log.per_step('mean_cosine')[rows]):11.3f}"
                f"  {np.nanmean(log.per_step('frac_negative_cosine')[rows]):13.3f}"
                f"  {np.nanmean(log.per_step('gradient_diversity')[rows]):14.3f}"
                f"  {np.nanmedian(log.per_step('noise_scale')[rows]):11.1f}"
            )
        ids = log.per_example("example_id")
        squared_norms = log.per_example("grad_norm").astype(np.float64) ** 2
        self_influence = np.bincount(ids, weights=squared_norms, minlength=len(flipped))
        top = np.argsort(-self_influence, kind="stable")[: max(1, len(flipped) // 10)]
        lines.append(
            f"top 10% by self-influence (sum of squared grad norms, {len(top)} examples): "
            f"{flipped[top].mean():.0%} have flipped labels "
            f"(vs {flipped.mean():.0%} of all examples)"
        )
        lines.append(
            "top 10 ids: " + ", ".join(f"{i}{'*' if flipped[i] else ''}" for i in top[:10])
        )
        lines.append("(* = flipped label)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_output", help="directory for the log")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--flip-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import keras

    import keras_gradtrack as kgt

    keras.utils.set_random_seed(args.seed)
    x, y, flipped = load_digits_with_flipped_labels(args.flip_fraction, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "digits_run.h5"
    model = build_model()
    model.gradient_tracking_summary()
    start = time.perf_counter()
    model.fit(
        {"pixels": x, "example_id": np.arange(len(x))},
        y,
        batch_size=64,
        epochs=args.epochs,
        verbose=2,
        callbacks=[kgt.HDF5GradientLogger(path, overwrite=True)],
    )
    print(f"trained {args.epochs} epochs in {time.perf_counter() - start:.1f} s; log: {path}")
    print(summarize(path, flipped))


if __name__ == "__main__":
    main()

"""What the statistics in fit's logs and in TensorBoard cost per step, on a small MLP.

Times `fit` per step (an epoch's wall time over its steps; the first epoch, which
traces, is dropped) for: plain `keras.Model`; `GradientTrackingModel` with
`HDF5GradientLogger`; the same plus `GradientStatisticsToLogs`; `GradientStatisticsToLogs`
alone (it tracks the steps itself); and `HDF5GradientLogger` plus
`TensorBoardGradientLogger` (histograms every step). Variants are interleaved in rounds
and the medians printed, with the time spent inside the two callbacks themselves.

```
python benchmarks/logs_cost.py                 # ~1 min on 2 CPU cores
python benchmarks/logs_cost.py --rounds 5 --steps 100
```
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
import tensorflow as tf

import keras_gradtrack as kgt

BATCH = 128
VARIANTS = ("plain", "hdf5", "hdf5+logs", "logs", "hdf5+tensorboard")


class EpochTimer(keras.callbacks.Callback):
    """Seconds per step of each epoch."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.per_step, self._start = steps, [], 0.0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.per_step.append((time.perf_counter() - self._start) / self.steps)


def timed(method: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """`method`, adding the seconds each call takes to `spent`."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return wrapper


def build(tracked: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    hidden = keras.layers.Dense(128, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    model = (kgt.GradientTrackingModel if tracked else keras.Model)(inputs, outputs)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def run(variant: str, steps: int, epochs: int, tmp: Path) -> tuple[float, float]:
    """Median seconds per step after the first epoch, and seconds per step in the
    callbacks measured (`GradientStatisticsToLogs` or `TensorBoardGradientLogger`)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 784)).astype("float32")
    y = rng.integers(0, 10, steps * BATCH)
    timer, spent = EpochTimer(steps), []
    callbacks: list[Any] = []
    if "hdf5" in variant:
        callbacks.append(kgt.HDF5GradientLogger(tmp / f"{variant}.h5", overwrite=True))
    if "logs" in variant:
        logs = kgt.GradientStatisticsToLogs()
        logs.on_train_batch_end = timed(logs.on_train_batch_end, spent)  # type: ignore[method-assign]
        logs._consume = timed(logs._consume, spent)  # type: ignore[method-assign]
        callbacks.append(logs)
    if "tensorboard" in variant:
        board = kgt.TensorBoardGradientLogger(tmp / f"tb_{time.time_ns()}")
        board._consume = timed(board._consume, spent)  # type: ignore[method-assign]
        callbacks.append(board)
    model = build(tracked=variant != "plain")
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[*callbacks, timer])
    in_callbacks = sum(spent) / (steps * epochs) if spent else 0.0
    return statistics.median(timer.per_step[1:]), in_callbacks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    figures: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant in VARIANTS:
                figures[variant].append(run(variant, args.steps, args.epochs, Path(tmp)))
    print(
        f"MLP 784-256-128-10, batch {BATCH}, {args.steps} steps x {args.epochs} epochs, "
        f"median of {args.rounds} rounds; TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    plain = statistics.median(step for step, _ in figures["plain"])
    print("| variant | ms per step | vs plain | ms per step in the callback |")
    print("| --- | --- | --- | --- |")
    for variant in VARIANTS:
        step = statistics.median(s for s, _ in figures[variant])
        inside = statistics.median(c for _, c in figures[variant])
        in_callback = f"{inside * 1e3:.3f}" if variant not in ("plain", "hdf5") else "-"
        print(f"| {variant} | {step * 1e3:.2f} | {step / plain:.2f}x | {in_callback} |")


if __name__ == "__main__":
    main()

"""Which kernel a convolution's per-example kernel gradients should come from, measured
in the whole tracked step: the choice `keras_gradtrack.rules.filter_gradients` makes
here, against the windows' products forced for every convolution.

One process per model builds plain and both tracked variants, traces each, then times
them in interleaved rounds (each round a `fit` per variant, its median step); a ratio
is the median over rounds of the round's time over plain's. Memory is not measured
here: `benchmarks/overhead.py` measures it in a fresh process per variant.

```
python benchmarks/conv_kernels.py                      # cnn and resnet, B=128, 7 rounds
python benchmarks/conv_kernels.py --models autoencoder --rounds 9
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import tensorflow as tf
from recurrent import fit_step_seconds
from report import cpu_features_line
from zoo import build_compiled, synthetic_batches

import keras_gradtrack as kgt
from keras_gradtrack.rules import filter_gradients

VARIANTS = ("plain", "tracked", "tracked_windows")


def windows_only(groups: int, channels: int | None, window: Any, xla: bool = False) -> str:
    """The choice of `filter_gradient_form`, but the windows' products for the grouped
    filter gradient."""
    form = CHOOSE(groups, channels, window, xla=xla)
    return filter_gradients.WINDOWS if form == filter_gradients.GROUPED else form


CHOOSE: Callable[..., str] = filter_gradients.filter_gradient_form


def traced(name: str, variant: str, dataset: Any) -> tuple[Any, list[Any]]:
    """The model of `variant`, its step traced (under the variant's kernel choice)."""
    if variant == "plain":
        model, callbacks = build_compiled(name, keras.Model), []
    else:
        model = build_compiled(name, kgt.GradientTrackingModel)
        callbacks = [kgt.HDF5GradientLogger(os.path.join(tempfile.mkdtemp(), "run.h5"))]
    if variant == "tracked_windows":
        filter_gradients.filter_gradient_form = windows_only
    try:
        model.fit(dataset, steps_per_epoch=3, verbose=0, callbacks=callbacks)
    finally:
        filter_gradients.filter_gradient_form = CHOOSE
    return model, callbacks


def compare(name: str, batch_size: int, rounds: int, steps: int) -> dict[str, Any]:
    data = synthetic_batches(name, batch_size, num_batches=2)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat().prefetch(2)
    models = {variant: traced(name, variant, dataset) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):
        for variant, (model, callbacks) in models.items():
            step = statistics.median(fit_step_seconds(model, dataset, steps, callbacks))
            times[variant].append(step * 1000)
    return {
        variant: (
            statistics.median(times[variant]),
            statistics.median(t / p for t, p in zip(times[variant], times["plain"])),
        )
        for variant in VARIANTS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,resnet", help="comma-separated, of zoo.py")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per fit")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(cpu_features_line())
    print("| model | variant | ms/step | / plain |")
    print("| --- | --- | --- | --- |")
    for name in args.models.split(","):
        for variant, (ms, ratio) in compare(name, args.batch_size, args.rounds, args.steps).items():
            print(f"| {name} | {variant} | {ms:.1f} | {ratio:.2f}x |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

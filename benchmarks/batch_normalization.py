"""What exact per-example gradients through BatchNormalization in training mode cost.

For a ResNet-style block model (three residual stages of Conv2D + BatchNormalization)
and MobileNetV2 (alpha 0.35, 32 x 32, `weights=None`), each training from scratch with
every BatchNormalization in training mode, times one training step of

* plain `keras.Model.fit`,
* `GradientTrackingModel.fit` with `track_batch_normalization = True` and an
  `HDF5GradientLogger` on every step, for each `batch_normalization_chunk_size` asked
  for (with the time to trace the tracked step),
* the same with `every_n_steps=50` (the average step of a 100-step fit: two tracked),
* `tape.jacobian` of the per-example losses over every variable (the simplest exact
  method: the whole model's Jacobian rows, no rules),
* the model converted by `kgt.convert_to_group_normalization`, plain and tracked on
  every step (a different model: examples independent, rules everywhere).

Prints the machine's load and a markdown table. Timings are medians over steps after
the first (trace) step; only meaningful on an otherwise idle machine.

```
python benchmarks/batch_normalization.py                          # both models, B = 32
python benchmarks/batch_normalization.py --models resnet --chunk-sizes 1,4,8,16
python benchmarks/batch_normalization.py --quick                  # smoke test
```
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
import tensorflow as tf
from report import StepTimes

import keras_gradtrack as kgt

MODELS = ("resnet", "mobilenetv2")
SHAPE = (32, 32, 3)
CLASSES = 10


def build_model(name: str) -> Any:
    """The named classifier (logits), a `GradientTrackingModel`, BatchNormalization training."""
    layers = keras.layers
    inputs = keras.Input(SHAPE)
    if name == "resnet":
        hidden = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
        hidden = layers.ReLU()(layers.BatchNormalization()(hidden))
        for filters, stride in ((16, 1), (32, 2), (64, 2)):
            shortcut = hidden
            hidden = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(hidden)
            hidden = layers.ReLU()(layers.BatchNormalization()(hidden))
            hidden = layers.Conv2D(filters, 3, padding="same", use_bias=False)(hidden)
            hidden = layers.BatchNormalization()(hidden)
            if stride != 1 or shortcut.shape[-1] != filters:
                shortcut = layers.Conv2D(filters, 1, stride, use_bias=False)(shortcut)
                shortcut = layers.BatchNormalization()(shortcut)
            hidden = layers.ReLU()(layers.Add()([hidden, shortcut]))
        features = layers.GlobalAveragePooling2D()(hidden)
    else:
        base = keras.applications.MobileNetV2(
            input_shape=SHAPE, alpha=0.35, include_top=False, weights=None, pooling="avg"
        )
        features = base(inputs)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(CLASSES)(features), name=name)
    compile_default(model)
    return model


def compile_default(model: Any) -> Any:
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def dataset(batch_size: int) -> Any:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * batch_size, *SHAPE), dtype=np.float32)
    y = rng.integers(0, CLASSES, 4 * batch_size)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat().prefetch(2)


def fit_times(model: Any, batch_size: int, steps: int, callbacks: list[Any]) -> list[float]:
    timer = StepTimes()
    model.fit(
        dataset(batch_size),
        steps_per_epoch=steps,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[timer, *callbacks],
    )
    return timer.times


def logger(directory: str, every_n_steps: int = 1) -> Any:
    path = Path(directory) / f"run_{time.monotonic_ns()}.h5"
    return kgt.HDF5GradientLogger(path, every_n_steps=every_n_steps)


def plain_copy(model: Any) -> Any:
    plain = keras.Model(model.inputs, model.outputs)
    return compile_default(plain)


def jacobian_step(model: Any) -> Callable[[Any, Any], Any]:
    """A train step from `tape.jacobian` of the per-example losses: norms and dots."""
    variables = model.trainable_variables
    optimizer = keras.optimizers.Adam()

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        jacobians = tape.jacobian(losses, variables)
        batch_gradient = [tf.reduce_mean(j, axis=0) for j in jacobians]
        rows = tf.shape(losses)[0]
        sq_norms = tf.add_n([tf.reduce_sum(tf.reshape(j * j, [rows, -1]), 1) for j in jacobians])
        dots = tf.add_n(
            [
                tf.reduce_sum(tf.reshape(j * g, [rows, -1]), 1)
                for j, g in zip(jacobians, batch_gradient)
            ]
        )
        optimizer.apply(batch_gradient, variables)
        return sq_norms, dots

    return step


def function_times(step: Callable[[Any, Any], Any], batch_size: int, steps: int) -> list[float]:
    times = []
    for x, y in dataset(batch_size).take(steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    return times


def median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def measure(
    name: str, batch_size: int, steps: int, chunk_sizes: list[int], jacobian: bool
) -> list[tuple[str, str, str]]:
    """Rows `(variant, ms per step, note)` for one model."""
    rows = []
    model = build_model(name)
    rows.append(("parameters", f"{model.count_params()}", ""))
    plain = plain_copy(model)
    plain_ms = 1e3 * median_after_first(fit_times(plain, batch_size, steps, []))
    rows.append(("plain Keras fit", f"{plain_ms:.1f}", "1.0x"))
    model.track_batch_normalization = True
    with tempfile.TemporaryDirectory() as directory:
        for chunk in chunk_sizes:
            model.batch_normalization_chunk_size = chunk
            times = fit_times(model, batch_size, steps, [logger(directory)])
            tracked_ms = 1e3 * median_after_first(times)
            rows.append(
                (
                    f"tracked every step, chunk {chunk}",
                    f"{tracked_ms:.1f}",
                    f"{tracked_ms / plain_ms:.1f}x; first step (trace) {times[0]:.1f} s",
                )
            )
        # Both steps traced first (the untracked one too), then a 100-step fit with two
        # tracked steps.
        fit_times(model, batch_size, 2, [logger(directory, every_n_steps=50)])
        times = fit_times(model, batch_size, 100, [logger(directory, every_n_steps=50)])
        average_ms = 1e3 * statistics.mean(times)
        rows.append(
            (
                f"tracked every 50 steps, chunk {chunk_sizes[-1]}",
                f"{average_ms:.1f}",
                f"{average_ms / plain_ms:.2f}x (mean of 100 steps)",
            )
        )
        if jacobian:
            jacobian_times = function_times(jacobian_step(plain_copy(model)), batch_size, 4)
            jacobian_ms = 1e3 * median_after_first(jacobian_times)
            rows.append(
                (
                    "tape.jacobian, every variable",
                    f"{jacobian_ms:.1f}",
                    f"{jacobian_ms / plain_ms:.1f}x",
                )
            )
        converted = kgt.convert_to_group_normalization(model)
        converted_plain = plain_copy(converted)
        group_plain_ms = 1e3 * median_after_first(fit_times(converted_plain, batch_size, steps, []))
        group_ms = 1e3 * median_after_first(
            fit_times(converted, batch_size, steps, [logger(directory)])
        )
        rows.append(
            ("GroupNormalization model, plain fit", f"{group_plain_ms:.1f}", "another model")
        )
        rows.append(
            (
                "GroupNormalization model, tracked every step",
                f"{group_ms:.1f}",
                f"{group_ms / group_plain_ms:.1f}x its plain fit",
            )
        )
    return rows


def machine() -> str:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}; uptime: {uptime}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument(
        "--chunk-sizes",
        default="8",
        help="comma-separated batch_normalization_chunk_size values (each traces again)",
    )
    parser.add_argument("--no-jacobian", action="store_true", help="skip tape.jacobian")
    parser.add_argument("--quick", action="store_true", help="smoke test: resnet, B = 8, 3 steps")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    models = ["resnet"] if args.quick else args.models.split(",")
    batch_size = 8 if args.quick else args.batch_size
    steps = 3 if args.quick else args.steps
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"Expected models among {list(MODELS)}. Received: {unknown}")
    lines = [f"Machine: {machine()}", "", f"Batch size {batch_size}; ms per training step.", ""]
    lines += ["| model | variant | ms / step | note |", "| --- | --- | --- | --- |"]
    for name in models:
        for variant, value, note in measure(
            name, batch_size, steps, chunk_sizes, not args.no_jacobian
        ):
            lines.append(f"| {name} | {variant} | {value} | {note} |")
    lines += ["", f"uptime at the end: {machine().rpartition('uptime: ')[2]}"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()

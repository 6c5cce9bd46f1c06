"""The fixed cost of one `fit`: what a tracked `fit` with `HDF5GradientLogger` spends
outside its steps (logger open and close, first-step checks, callbacks' begin and end),
against plain `fit` of the same model.

Both models trace their steps first; then, in interleaved pairs, each runs `fit` for
`--steps` steps and the fixed cost is the `fit` wall time minus the sum of its step
times (each step timed from `on_train_batch_begin` to `on_train_batch_end`). Prints the
median over pairs of plain's, tracked's and their paired difference:

```
python benchmarks/fixed_cost.py                  # cnn, B=128, 2 steps, 15 pairs, ~15 s
python benchmarks/fixed_cost.py --model mlp --pairs 30
python benchmarks/fixed_cost.py --no-autotune    # without TensorFlow's iterator teardown wait
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import tensorflow as tf
from report import StepTimes
from zoo import ZOO, build_compiled, synthetic_batches

import keras_gradtrack as kgt


def fixed_seconds(model: Any, dataset: Any, steps: int, log_path: str | None) -> float:
    """One `fit` of `steps` steps: its wall time outside the steps."""
    times = StepTimes()
    # The logger sits between the two marks of a step, so its per-step work counts as
    # step time; only what it does once per fit is left over.
    callbacks: list[Any] = [times]
    if log_path is not None:
        callbacks.insert(0, kgt.HDF5GradientLogger(log_path))
    began = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, verbose=0, callbacks=callbacks, shuffle=False)
    return time.perf_counter() - began - sum(times.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(ZOO), default="cnn")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="steps per fit (2)")
    parser.add_argument("--pairs", type=int, default=15, help="interleaved pairs (15)")
    parser.add_argument(
        "--no-autotune", action="store_true", help="tf.data autotuning off (see the README)"
    )
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    plain = build_compiled(args.model, keras.Model)
    tracked = build_compiled(args.model, kgt.GradientTrackingModel)
    tracked.set_weights(plain.get_weights())
    data = synthetic_batches(args.model, args.batch_size)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(args.batch_size).repeat()
    if args.no_autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
    directory = tempfile.mkdtemp(prefix="fixed-cost-")
    paths = (os.path.join(directory, f"{i}.h5") for i in range(10**9))
    fixed_seconds(plain, dataset, args.steps, None)  # traces the steps
    fixed_seconds(tracked, dataset, args.steps, next(paths))

    plain_ms, tracked_ms = [], []
    for pair in range(args.pairs):
        # Alternate which goes first, so neither always follows the other.
        order = [(plain, None), (tracked, next(paths))]
        for model, path in order if pair % 2 == 0 else order[::-1]:
            seconds = fixed_seconds(model, dataset, args.steps, path)
            (plain_ms if path is None else tracked_ms).append(1e3 * seconds)
    extra = [t - p for p, t in zip(plain_ms, tracked_ms)]
    print(
        f"{args.model}, B={args.batch_size}, {args.steps} steps per fit, {args.pairs} pairs, "
        f"tf.data autotune {'off' if args.no_autotune else 'on'}, "
        f"load average {os.getloadavg()[0]:.1f}\n"
        f"fixed ms per fit, median: plain {statistics.median(plain_ms):.1f}, "
        f"tracked {statistics.median(tracked_ms):.1f}, "
        f"tracked - plain (paired) {statistics.median(extra):.1f}\n"
        f"quartiles, tracked - plain: {', '.join(f'{q:.1f}' for q in quartiles(extra))}"
    )


def quartiles(values: list[float]) -> list[float]:
    """First quartile, median, third quartile: the spread is wide on a busy machine."""
    return statistics.quantiles(values, n=4) if len(values) > 1 else values * 3


if __name__ == "__main__":
    main()

"""What the example-independence guard costs, once per fit, beside a training step.

For each benchmark-zoo model at one batch size: the guard's time (its two forward
passes of the batch in inference mode, eager, and the comparison), the median time of
one plain `train_on_batch` step, and their ratio: how many plain steps the guard costs.
The guard runs once per `fit` (before its first tracked step), so a fit of N steps
pays ratio / N of a step per step.

    python benchmarks/independence_guard.py --batch-size 128 --models mlp cnn text transformer
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
from zoo import ZOO, build_compiled, synthetic_batches

import keras_gradtrack as kgt
from keras_gradtrack.engine.independence import find_example_mixing


def seconds(function, repeats: int) -> list[float]:
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        found.append(time.perf_counter() - start)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "text", "transformer"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("| model | guard (ms) | plain step (ms) | guard / step |")
    print("| --- | --- | --- | --- |")
    for name in args.models:
        guard, step = measure(name, args.batch_size, args.repeats)
        print(
            f"| {name} ({ZOO[name].description}) | {guard * 1e3:.1f} | {step * 1e3:.1f} | "
            f"{guard / step:.1f}x |"
        )


def measure(name: str, batch_size: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the guard and of one plain step, for the named model."""
    keras.utils.set_random_seed(0)
    model = build_compiled(name, kgt.GradientTrackingModel)
    x, y = synthetic_batches(name, batch_size, num_batches=1)
    model.train_on_batch(x, y)  # traced and built
    step = statistics.median(seconds(lambda: model.train_on_batch(x, y), repeats))
    guard = statistics.median(seconds(lambda: find_example_mixing(model, x, y), repeats))
    return guard, step


if __name__ == "__main__":
    main()

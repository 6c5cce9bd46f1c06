"""What the per-example kernel gradients of the zoo CNN's second convolution cost beside
its batch kernel gradient: the floor under the CNN's private step on TensorFlow.

The CNN's second Conv2D (32 -> 32 channels, 3x3, on 26x26, B=128) needs each example's
kernel gradient for its norm (its Gram form costs about 20x more), where a plain step
computes one batch kernel gradient. Times, in interleaved rounds (median wall and
process CPU milliseconds per call, each call waited for):

* `batch`: the batch's `Conv2DBackpropFilter`, what the plain step computes;
* `per-example (grouped)`: `filter_gradients.grouped_filter_gradients`, the private
  step's kernel here (oneDNN), whole: the examples moved to channels, one grouped
  `Conv2DBackpropFilter`, the result moved back to `(B, n)`;
* its parts: `moves in` (the input and output gradient as `(1, H, W, B C)`),
  `grouped core` (the grouped filter gradient alone), `move out`;
* `per-example (windows)`: the nine windows' batched products
  (`windows.per_example_kernel_gradients`), the other kernel.

```
python benchmarks/conv_bound.py               # B=128, 9 rounds of 5 calls
python benchmarks/conv_bound.py --rounds 15
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import tensorflow as tf

from keras_gradtrack.rules import filter_gradients
from keras_gradtrack.rules.windows import Window, per_example_kernel_gradients, stacked_windows

CALLS = 5  # per variant and round


class Geometry:
    """The second convolution's geometry, as `Window.of` reads a layer."""

    kernel_size = (3, 3)
    strides = (1, 1)
    dilation_rate = (1, 1)
    padding = "valid"
    data_format = "channels_last"


def variants(batch: int) -> dict[str, tuple[Any, tuple[tf.Tensor, ...]]]:
    """`{name: (compiled function, its arguments)}`."""
    window = Window.of(Geometry())
    source = tf.random.normal([batch, 26, 26, 32])
    target = tf.random.normal([batch, 24, 24, 32])

    @tf.function
    def batch_gradient(source: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        return tf.raw_ops.Conv2DBackpropFilter(
            input=source,
            filter_sizes=[3, 3, 32, 32],
            out_backprop=target,
            strides=[1, 1, 1, 1],
            padding="VALID",
        )

    @tf.function
    def grouped(source: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        return filter_gradients.grouped_filter_gradients(source, target, window)

    @tf.function
    def moves_in(source: tf.Tensor, target: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        size = tf.shape(source)[0]
        return (
            filter_gradients.examples_as_channels(source, size),
            filter_gradients.examples_as_channels(target, size),
        )

    @tf.function
    def grouped_core(source: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        return tf.raw_ops.Conv2DBackpropFilter(
            input=source,
            filter_sizes=[3, 3, 32, batch * 32],
            out_backprop=target,
            strides=[1, 1, 1, 1],
            padding="VALID",
        )

    @tf.function
    def move_out(gradient: tf.Tensor) -> tf.Tensor:
        per_example = tf.reshape(gradient, [288, batch, 32])
        return tf.reshape(tf.einsum("kbf->bkf", per_example), [batch, -1])

    @tf.function
    def windows(source: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        slices, targets = stacked_windows([(source, target)], window)
        return per_example_kernel_gradients(slices, targets, 1)

    moved = moves_in(source, target)
    return {
        "batch": (batch_gradient, (source, target)),
        "per-example (grouped)": (grouped, (source, target)),
        "moves in": (moves_in, (source, target)),
        "grouped core": (grouped_core, moved),
        "move out": (move_out, (grouped_core(*moved),)),
        "per-example (windows)": (windows, (source, target)),
    }


def timed(function: Any, arguments: tuple[tf.Tensor, ...]) -> tuple[float, float]:
    """`(wall, process CPU)` seconds per call, over `CALLS` calls waited for."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(CALLS):
        tf.nest.map_structure(lambda tensor: tensor.numpy(), function(*arguments))
    return (time.perf_counter() - wall) / CALLS, (time.process_time() - cpu) / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    found = variants(args.batch_size)
    for function, arguments in found.values():
        timed(function, arguments)  # traced
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in found}
    for _ in range(args.rounds):
        for name, (function, arguments) in found.items():
            times[name].append(timed(function, arguments))
    print(
        f"# {os.cpu_count()} CPUs, TensorFlow {tf.__version__}, B={args.batch_size}, "
        f"{args.rounds} interleaved rounds of {CALLS} calls, medians"
    )
    print("| kernel | wall (ms) | CPU (ms) | CPU / batch |")
    print("| --- | --- | --- | --- |")
    batch_cpu = statistics.median(cpu for _, cpu in times["batch"])
    for name, found_times in times.items():
        wall = statistics.median(w for w, _ in found_times)
        cpu = statistics.median(c for _, c in found_times)
        print(f"| {name} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} | {cpu / batch_cpu:.2f}x |")


if __name__ == "__main__":
    main()

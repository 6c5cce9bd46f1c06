"""Every way TensorFlow offers to compute a convolution's per-example kernel gradients,
timed alone against the batch's own filter gradient, per shape.

A tracked step that materializes a convolution's per-example kernel gradients takes
the batch gradient as their sum, so the step costs the per-example kernel over the
batch kernel more than plain. The forms, each `(B, kernel size)` from the layer's
input `(B, H, W, C)` and output gradient `(B, H', W', F)` (stride 1, 3x3, valid or
same padding):

* `batch`: `Conv2DBackpropFilter` of the whole batch (plain's kernel, summed);
* `grouped`: the library's grouped `Conv2DBackpropFilter` with the examples as groups
  (oneDNN only), its axis moves included (`rules.filter_gradients`);
* `windows`: the library's products per kernel offset (`rules.windows`);
* `patches`: `tf.image.extract_patches`, then one batched product;
* `stacked`: the nine windows concatenated along channels, then one batched product;
* `vectorized_map`: `tf.vectorized_map` of a one-example filter gradient;
* `map_fn`: `tf.map_fn` of the same, two at a time;
* `swapped`: the filter gradient as a forward convolution (channels as the batch, the
  examples as groups, the output gradient as the filter).

Each form is a `tf.function` over fixed inputs; a time is the median of `--repeats`
calls per round, then the median over interleaved rounds.

```
python benchmarks/filter_gradient_forms.py                 # the zoo's shapes, B=128
python benchmarks/filter_gradient_forms.py --shapes 26x26x32x32 --rounds 9
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import numpy as np
import tensorflow as tf
from report import cpu_features_line

from keras_gradtrack.rules import filter_gradients, windows

# height x width x channels in x filters, and the padding: the zoo's convolutions.
SHAPES = {
    "26x26x32x32": "valid",  # the CNN's second convolution
    "14x14x32x32": "same",  # the autoencoder's
    "16x16x32x32": "same",  # ResNet-8's
    "8x8x64x64": "same",  # ResNet-8's
    "32x32x16x16": "same",  # ResNet-8's
}
KERNEL = 3
Form = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def forms(batch: int, channels: int, filters: int, padding: str) -> dict[str, Form]:
    """Each form for inputs `(B, H, W, C)` and output gradients `(B, H', W', F)`."""
    window = windows.Window((KERNEL, KERNEL), (1, 1), (1, 1), padding)
    offsets = [(i, j) for i in range(KERNEL) for j in range(KERNEL)]

    def padded(x: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
        return windows.padded(x, d.shape[1:3], window)

    def one_example(pair: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        x, d = pair
        return batch_filter_gradient(x[tf.newaxis], d[tf.newaxis], channels, filters)

    def stacked_windows(x: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
        x = padded(x, d)
        rows, cols = d.shape[1], d.shape[2]
        return tf.concat([x[:, i : i + rows, j : j + cols] for i, j in offsets], axis=-1)

    def product(windows_: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
        flat = tf.reshape(windows_, [batch, -1, KERNEL * KERNEL * channels])
        return tf.matmul(flat, tf.reshape(d, [batch, -1, filters]), transpose_a=True)

    def patches(x: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
        size, ones = [1, KERNEL, KERNEL, 1], [1, 1, 1, 1]
        return product(tf.image.extract_patches(padded(x, d), size, ones, ones, "VALID"), d)

    def swapped(x: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
        images = tf.einsum("bhwc->chwb", padded(x, d))
        kernel = tf.reshape(tf.einsum("bhwf->hwbf", d), [*d.shape[1:3], 1, batch * filters])
        return tf.nn.conv2d(images, kernel, 1, "VALID")

    def library_windows(x: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
        slices = windows.window_slices(x, d.shape[1:3], window)
        return windows.per_example_kernel_gradients(slices, tf.reshape(d, [batch, -1, filters]), 1)

    return {
        "batch": lambda x, d: batch_filter_gradient(padded(x, d), d, channels, filters),
        "grouped": lambda x, d: filter_gradients.grouped_filter_gradients(x, d, window),
        "windows": library_windows,
        "patches": patches,
        "stacked": lambda x, d: product(stacked_windows(x, d), d),
        "vectorized_map": lambda x, d: tf.vectorized_map(one_example, (padded(x, d), d)),
        "map_fn": lambda x, d: tf.map_fn(
            one_example, (padded(x, d), d), fn_output_signature=tf.float32, parallel_iterations=2
        ),
        "swapped": swapped,
    }


def batch_filter_gradient(x: tf.Tensor, d: tf.Tensor, channels: int, filters: int) -> tf.Tensor:
    """The batch's filter gradient of a "valid" 3x3 convolution."""
    return tf.raw_ops.Conv2DBackpropFilter(
        input=x,
        filter_sizes=[KERNEL, KERNEL, channels, filters],
        out_backprop=d,
        strides=[1, 1, 1, 1],
        padding="VALID",
    )


def time_shape(shape: str, padding: str, batch: int, rounds: int, repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each form for one shape."""
    height, width, channels, filters = (int(part) for part in shape.split("x"))
    shrink = KERNEL - 1 if padding == "valid" else 0
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, height, width, channels)), tf.float32)
    d = tf.constant(
        rng.standard_normal((batch, height - shrink, width - shrink, filters)), tf.float32
    )
    functions = {
        name: tf.function(form) for name, form in forms(batch, channels, filters, padding).items()
    }
    runs = {}
    for name, function in functions.items():
        try:
            function(x, d).numpy()
            runs[name] = function
        except (tf.errors.OpError, ValueError) as error:  # a kernel this build lacks
            print(f"{shape} {name}: not run here ({type(error).__name__})")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, function in runs.items():
            calls = []
            for _ in range(repeats):
                began = time.perf_counter()
                function(x, d).numpy()
                calls.append(time.perf_counter() - began)
            times[name].append(statistics.median(calls))
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="HxWxCxF, comma-separated")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    names = list(forms(1, 1, 1, "valid"))
    print(cpu_features_line())
    print(f"B={args.batch_size}, 3x3 kernels, stride 1; ms per call (per-example / batch)")
    print("| input HxWxC -> F, padding | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for shape in args.shapes.split(","):
        padding = SHAPES.get(shape, "valid")
        ms = time_shape(shape, padding, args.batch_size, args.rounds, args.repeats)
        cells = [
            f"{ms[n]:.1f}" + ("" if n == "batch" else f" ({ms[n] / ms['batch']:.1f}x)")
            if n in ms
            else "-"
            for n in names
        ]
        print(f"| {shape}, {padding} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

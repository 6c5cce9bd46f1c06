"""`keras_gradtrack.autodiff` on TensorFlow, JAX and PyTorch: one table, each backend in
a process of its own (Keras picks its backend when imported).

The model of docs/autodiff.md's input-gradient section, Dense 1095-256-256-8 (ReLU) at
B=64: each function's time per call (the median of `--repeats` calls after one warm-up
call), on TensorFlow compiled (`tf.function`, the same `fn` object every call), on JAX
and PyTorch eagerly. Beside them, the model's forward call and each backend's own VJP
written by hand: a `tf.function` over a tape, `jax.jit` over `jax.vjp` of
`stateless_call`, `torch.autograd.grad`.

```
python benchmarks/autodiff_backends.py
python benchmarks/autodiff_backends.py --backends jax torch --repeats 5
```
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

BACKENDS = ("tensorflow", "jax", "torch")
ROWS = {
    "call": "`model(x)`",
    "own_vjp": "the backend's own VJP, by hand",
    "vjp": "`autodiff.vjp(model, x, v)`",
    "jvp": "`autodiff.jvp(model, x, t)`",
    "grad_weights": "`autodiff.grad(loss, model.trainable_variables)`",
    "batch_jacobian": "`autodiff.batch_jacobian(model, x)` (64 x 8 x 1095)",
    "output_gradients": "`autodiff.output_gradients(model, x, chunk_size=8)` (8 features)",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    return parser.parse_args()


def seconds_per_call(function: Callable[[], Any], repeats: int) -> float:
    import keras

    def run() -> None:
        keras.ops.convert_to_numpy(keras.tree.flatten(function())[0])

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def own_vjp(model: Any, x: Any, v: Any) -> Callable[[], Any]:
    """The backend's own VJP of `model` at `x` with cotangent `v`, written by hand."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def pulled(x: Any, v: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = model(x)
            return tape.gradient(y, x, output_gradients=v)

        x, v = tf.constant(x), tf.constant(v)
        return lambda: pulled(x, v)
    if backend == "jax":
        import jax

        @jax.jit
        def pulled_jax(trainable: Any, non_trainable: Any, x: Any, v: Any) -> Any:
            def output(x: Any) -> Any:
                return model.stateless_call(trainable, non_trainable, x)[0]

            return jax.vjp(output, x)[1](v)[0]

        trainable = [w.value for w in model.trainable_variables]
        non_trainable = [w.value for w in model.non_trainable_variables]
        return lambda: pulled_jax(trainable, non_trainable, x, v)
    import torch

    def pulled_torch() -> Any:
        leaf = torch.as_tensor(x).requires_grad_(True)
        return torch.autograd.grad(model(leaf), leaf, grad_outputs=torch.as_tensor(v))[0]

    return pulled_torch


def child(args: argparse.Namespace) -> None:
    import keras
    import numpy as np

    from keras_gradtrack import autodiff

    keras.utils.set_random_seed(0)
    inputs = keras.Input((1095,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    hidden = keras.layers.Dense(256, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(8)(hidden))
    rng = np.random.default_rng(0)
    x = rng.random((args.batch_size, 1095), dtype=np.float32)
    v = np.ones((args.batch_size, 8), "float32")
    t = rng.random((args.batch_size, 1095), dtype=np.float32)

    def loss(_: Any) -> Any:
        return keras.ops.sum(model(x))

    calls = {
        "call": lambda: model(x),
        "own_vjp": own_vjp(model, x, v),
        "vjp": lambda: autodiff.vjp(model, x, v),
        "jvp": lambda: autodiff.jvp(model, x, t),
        "grad_weights": lambda: autodiff.grad(loss, model.trainable_variables),
        "batch_jacobian": lambda: autodiff.batch_jacobian(model, x),
        "output_gradients": lambda: [
            g for _, g in autodiff.output_gradients(model, x, chunk_size=8)
        ],
    }
    times = {name: seconds_per_call(call, args.repeats) for name, call in calls.items()}
    print(json.dumps(times), flush=True)


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    found = {}
    for backend in args.backends:
        environment = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        command = [sys.executable, __file__, "--child", backend, "--repeats", str(args.repeats)]
        command += ["--batch-size", str(args.batch_size)]
        result = subprocess.run(command, env=environment, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{backend} failed:\n{result.stderr[-3000:]}")
        found[backend] = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; ", end="")
    print(f"Dense 1095-256-256-8, B={args.batch_size}, median of {args.repeats} calls, ms\n")
    print("| | " + " | ".join(args.backends) + " |")
    print("| --- |" + " ---: |" * len(args.backends))
    for name, label in ROWS.items():
        cells = [f"{found[backend][name] * 1e3:.2f}" for backend in args.backends]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""What exact per-example gradient statistics cost in Keras `fit` on the JAX backend.

For each model of `zoo.py` and batch size: milliseconds per training step of plain
`keras.Model.fit` and of `GradientTrackingModel.fit` with every step tracked (the
default statistics, reported to a subscriber that reads every step's values to the
host in blocks of 100 steps, as `HDF5GradientLogger` does, and keeps nothing: no HDF5
file, so the number is the engine's), their ratio, and the peak device memory (GPU: the
allocator's peak; CPU: the process's peak RSS) after plain fits and after tracked
ones. Each (model, batch size) runs in a fresh process; plain and tracked fits
alternate in rounds and the medians are reported. Imports no TensorFlow.

```
python benchmarks/jax_overhead.py                                  # mlp, cnn, transformer at B=128
python benchmarks/jax_overhead.py --batch-sizes 128,512 --out table.md
python benchmarks/jax_overhead.py --quick                          # smoke test
```
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MESSAGE_PREFIX = "@@jax_overhead "
DEFAULT_MODELS = "mlp,cnn,transformer"
NUM_BATCHES = 4  # distinct batches of synthetic data, cycled through by `fit`
# glibc hands large freed buffers back to the OS and maps them anew, zeroed, at the next
# step: XLA's CPU temporaries (per-example gradients of a few MiB) then cost page faults
# in some processes and not in others (tracked steps 13 or 22 ms on the same model).
# Kept in the heap, both variants run at their steady speed.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "2000000000"}


def peak_memory_bytes() -> int:
    """The device allocator's peak (GPU), or the process's peak RSS (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(name: str, batch_size: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Times plain and tracked `fit` of one model in alternating rounds."""
    import jax
    import keras
    from zoo import build_compiled, synthetic_batches

    import keras_gradtrack as kgt
    from keras_gradtrack import statistics as kgt_statistics

    if keras.backend.backend() != "jax":
        raise SystemExit(f"Expected KERAS_BACKEND=jax. Received: {keras.backend.backend()}")
    # Not keras.utils.set_random_seed: it imports TensorFlow where installed. The
    # tracked model starts from the plain one's weights.
    plain = build_compiled(name, keras.Model)
    tracked = build_compiled(name, kgt.GradientTrackingModel)
    tracked.set_weights(plain.get_weights())
    x, y = synthetic_batches(name, batch_size, NUM_BATCHES)
    default_statistics = kgt_statistics.resolve(None)

    def fit(model: Any, epochs: int) -> float:
        if model is tracked:
            reader = BlockReader()
            model.gradient_tracking.subscribe(
                "bench", default_statistics, 1, reader.consume, finish=reader.read
            )
        begin = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.trainable_variables])
        return time.perf_counter() - begin

    memory_before = peak_memory_bytes()
    warm = {"plain": fit(plain, 1)}  # traces and compiles
    memory_plain = peak_memory_bytes()
    warm["tracked"] = fit(tracked, 1)
    memory_tracked = peak_memory_bytes()
    ms = timed_rounds({"plain": plain, "tracked": tracked}, fit, rounds, seconds)
    plain_ms, tracked_ms = ms["plain"], ms["tracked"]
    return {
        "model": name,
        "batch_size": batch_size,
        "plain_ms": plain_ms,
        "tracked_ms": tracked_ms,
        "ratio": tracked_ms / plain_ms,
        "memory_before_mib": memory_before / 2**20,
        "memory_plain_mib": memory_plain / 2**20,
        "memory_tracked_mib": memory_tracked / 2**20,
        "memory_ratio": (memory_tracked - memory_before) / max(memory_plain - memory_before, 1),
        "paths": [t.path for t in tracked.gradient_tracking_plan()],
        "tensorflow_imported": "tensorflow" in sys.modules,
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.devices()[0].platform,
    }


def timed_rounds(
    models: dict[str, Any], fit: Callable[[Any, int], float], rounds: int, seconds: float
) -> dict[str, float]:
    """Each variant's median milliseconds per step: one fit sizes its epochs to about
    `seconds`, then `rounds` rounds time every variant, in alternating order."""
    epochs = {}
    for variant, model in models.items():
        per_step = fit(model, 1) / NUM_BATCHES
        epochs[variant] = max(1, int(seconds / max(per_step, 1e-6) / NUM_BATCHES))
    per_step_ms: dict[str, list[float]] = {variant: [] for variant in models}
    for round_index in range(rounds):
        order = list(models) if round_index % 2 == 0 else list(models)[::-1]
        for variant in order:
            wall = fit(models[variant], epochs[variant])
            per_step_ms[variant].append(1000 * wall / (epochs[variant] * NUM_BATCHES))
    return {variant: statistics.median(found) for variant, found in per_step_ms.items()}


def run_child(
    name: str,
    batch_size: int,
    args: argparse.Namespace,
    script: str = __file__,
    prefix: str = MESSAGE_PREFIX,
) -> dict[str, Any]:
    """Runs `script --child name:batch_size` in a fresh JAX process; its row (the line
    after `prefix`), or the error it printed."""
    env = {**os.environ, "KERAS_BACKEND": "jax", **MALLOC_SETTINGS}
    root = str(Path(script).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        script,
        "--child",
        f"{name}:{batch_size}",
        f"--rounds={args.rounds}",
        f"--seconds={args.seconds}",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith(prefix):
            return dict(json.loads(line[len(prefix) :]))
    return {"model": name, "batch_size": batch_size, "error": result.stderr[-2000:]}


def arguments(description: str) -> argparse.Namespace:
    """The command line both JAX benchmarks take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--batch-sizes", default="128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="wall time per timed fit")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--quick", action="store_true", help="one round of short fits")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 0.2
    return args


def report(rows: list[dict[str, Any]], args: argparse.Namespace, markdown: str, note: str) -> None:
    """Prints the table under a header naming the device, CPU, settings and time
    (`note`: what else the header says); also writes it to `args.out`."""
    devices = sorted({f"{r['platform']}: {r['device']}" for r in rows if "device" in r})
    header = (
        f"JAX backend, {', '.join(devices) or 'no device'}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"rounds={args.rounds}, ~{args.seconds}s per timed fit; {note}"
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    text = f"{header}\n\n{markdown}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | B | plain ms/step | tracked ms/step | tracked / plain "
        "| peak MiB plain | peak MiB tracked | memory growth tracked / plain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['batch_size']} | failed | | | | | |")
            continue
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {row['plain_ms']:.2f} "
            f"| {row['tracked_ms']:.2f} | {row['ratio']:.2f}x "
            f"| {row['memory_plain_mib']:.0f} | {row['memory_tracked_mib']:.0f} "
            f"| {row['memory_ratio']:.2f}x |"
        )
    return "\n".join(lines)


class BlockReader:
    """Keeps each step's values and reads them to the host every `BLOCK` steps and at
    the end of the fit (a logger's blocks, without the file)."""

    BLOCK = 100

    def __init__(self) -> None:
        self.kept: list[Any] = []

    def consume(self, report: Any) -> None:
        self.kept.append(report.values)
        if len(self.kept) >= self.BLOCK:
            self.read()

    def read(self) -> None:
        for values in self.kept:
            for name in values:
                np.asarray(values[name])
        self.kept = []


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    if args.child:
        name, batch_size = args.child.split(":")
        row = child(name, int(batch_size), args.rounds, args.seconds)
        print(MESSAGE_PREFIX + json.dumps(row), flush=True)
        return
    rows = []
    for name in args.models.split(","):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            row = run_child(name, batch_size, args)
            rows.append(row)
            if "error" in row:
                print(f"{name} B={batch_size} failed:\n{row['error']}", file=sys.stderr)
            elif row["tensorflow_imported"]:
                print(f"{name} B={batch_size}: TensorFlow was imported", file=sys.stderr)
            else:
                print(
                    f"{name:12s} B={batch_size:<4d} plain {row['plain_ms']:8.2f} ms  "
                    f"tracked {row['tracked_ms']:8.2f} ms  {row['ratio']:.2f}x  "
                    f"paths {row['paths']}",
                    flush=True,
                )
    report(rows, args, table(rows), "large buffers kept in the heap (MALLOC_MMAP_THRESHOLD_); ")


if __name__ == "__main__":
    main()

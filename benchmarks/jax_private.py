"""What a private (DP-SGD) step costs in Keras `fit` on the JAX backend.

For each model of `zoo.py` and batch size: milliseconds per training step of plain
`keras.Model.fit`, of `GradientTrackingModel.fit` after `make_private(l2_norm_clip=1,
noise_multiplier=0)` (every step clipped, no noise drawn) and after `make_private(
l2_norm_clip=1, noise_multiplier=1)` (clipped and noised), no logger, and the ratios. Each
(model, batch size) runs in a fresh process; plain and private fits alternate in
rounds and the medians are reported. Imports no TensorFlow.

```
python benchmarks/jax_private.py                                  # mlp, cnn, transformer at B=128
python benchmarks/jax_private.py --batch-sizes 128,512 --out table.md
python benchmarks/jax_private.py --quick                          # smoke test
```
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jax_overhead import MALLOC_SETTINGS

MESSAGE_PREFIX = "@@jax_private "
DEFAULT_MODELS = "mlp,cnn,transformer"
NUM_BATCHES = 4  # distinct batches of synthetic data, cycled through by `fit`


def child(name: str, batch_size: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Times plain and private `fit` of one model in alternating rounds."""
    import jax
    import keras
    from zoo import build_compiled, synthetic_batches

    import keras_gradtrack as kgt

    if keras.backend.backend() != "jax":
        raise SystemExit(f"Expected KERAS_BACKEND=jax. Received: {keras.backend.backend()}")
    plain = build_compiled(name, keras.Model)
    models = {"plain": plain}
    for variant, sigma in (("clipped", 0.0), ("private", 1.0)):
        model = models[variant] = build_compiled(name, kgt.GradientTrackingModel)
        model.set_weights(plain.get_weights())
        model.make_private(l2_norm_clip=1.0, noise_multiplier=sigma)
    x, y = synthetic_batches(name, batch_size, NUM_BATCHES)

    def fit(model: Any, epochs: int) -> float:
        begin = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.trainable_variables])
        return time.perf_counter() - begin

    for model in models.values():
        fit(model, 1)  # traces and compiles
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
    ms = {variant: statistics.median(found) for variant, found in per_step_ms.items()}
    return {
        "model": name,
        "batch_size": batch_size,
        "plain_ms": ms["plain"],
        "clipped_ms": ms["clipped"],
        "private_ms": ms["private"],
        "paths": [t.path for t in models["private"].gradient_tracking_plan()],
        "tensorflow_imported": "tensorflow" in sys.modules,
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.devices()[0].platform,
    }


def run_child(name: str, batch_size: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": "jax", **MALLOC_SETTINGS}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        __file__,
        "--child",
        f"{name}:{batch_size}",
        f"--rounds={args.rounds}",
        f"--seconds={args.seconds}",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith(MESSAGE_PREFIX):
            return dict(json.loads(line[len(MESSAGE_PREFIX) :]))
    return {"model": name, "batch_size": batch_size, "error": result.stderr[-2000:]}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | B | plain ms/step | clipped (sigma=0) ms/step | private (sigma=1) "
        "ms/step | clipped / plain | private / plain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['batch_size']} | failed | | | | |")
            continue
        plain = row["plain_ms"]
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {plain:.2f} | {row['clipped_ms']:.2f} "
            f"| {row['private_ms']:.2f} | {row['clipped_ms'] / plain:.2f}x "
            f"| {row['private_ms'] / plain:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
            else:
                print(
                    f"{name:12s} B={batch_size:<4d} plain {row['plain_ms']:8.2f} ms  "
                    f"clipped {row['clipped_ms']:8.2f} ms  private {row['private_ms']:8.2f} ms  "
                    f"paths {row['paths']}",
                    flush=True,
                )
    devices = sorted({f"{r['platform']}: {r['device']}" for r in rows if "device" in r})
    header = (
        f"JAX backend, {', '.join(devices) or 'no device'}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"rounds={args.rounds}, ~{args.seconds}s per timed fit; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    text = f"{header}\n\n{table(rows)}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

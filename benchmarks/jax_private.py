"""What a private (DP-SGD) step costs in Keras `fit` on the JAX backend.

For each model of `zoo.py` and batch size: milliseconds per training step of plain
`keras.Model.fit`, of `GradientTrackingModel.fit` after `make_private(l2_norm_clip=1,
noise_multiplier=0)` (every step clipped, no noise drawn), after `make_private(
l2_norm_clip=1, noise_multiplier=1)` (clipped and noised) and after the same with
`secure_noise=True` (the noise drawn on the host from `os.urandom`), no logger, and the
ratios. Each
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
import sys
import time
from typing import Any

import jax_overhead
from jax_overhead import arguments, report, timed_rounds

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
    for variant, sigma, secure in (
        ("clipped", 0.0, False),
        ("private", 1.0, False),
        ("secure", 1.0, True),
    ):
        model = models[variant] = build_compiled(name, kgt.GradientTrackingModel)
        model.set_weights(plain.get_weights())
        model.make_private(l2_norm_clip=1.0, noise_multiplier=sigma, secure_noise=secure)
    x, y = synthetic_batches(name, batch_size, NUM_BATCHES)

    def fit(model: Any, epochs: int) -> float:
        begin = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.trainable_variables])
        return time.perf_counter() - begin

    for model in models.values():
        fit(model, 1)  # traces and compiles
    ms = timed_rounds(models, fit, rounds, seconds)
    return {
        "model": name,
        "batch_size": batch_size,
        "plain_ms": ms["plain"],
        "clipped_ms": ms["clipped"],
        "private_ms": ms["private"],
        "secure_ms": ms["secure"],
        "paths": [t.path for t in models["private"].gradient_tracking_plan()],
        "tensorflow_imported": "tensorflow" in sys.modules,
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.devices()[0].platform,
    }


def run_child(name: str, batch_size: int, args: argparse.Namespace) -> dict[str, Any]:
    return jax_overhead.run_child(name, batch_size, args, __file__, MESSAGE_PREFIX)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | B | plain ms/step | clipped (sigma=0) ms/step | private (sigma=1) "
        "ms/step | secure noise ms/step | clipped / plain | private / plain | secure / plain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['batch_size']} | failed | | | | | | |")
            continue
        plain = row["plain_ms"]
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {plain:.2f} | {row['clipped_ms']:.2f} "
            f"| {row['private_ms']:.2f} | {row['secure_ms']:.2f} "
            f"| {row['clipped_ms'] / plain:.2f}x | {row['private_ms'] / plain:.2f}x "
            f"| {row['secure_ms'] / plain:.2f}x |"
        )
    return "\n".join(lines)


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
            else:
                print(
                    f"{name:12s} B={batch_size:<4d} plain {row['plain_ms']:8.2f} ms  "
                    f"clipped {row['clipped_ms']:8.2f} ms  private {row['private_ms']:8.2f} ms  "
                    f"secure {row['secure_ms']:8.2f} ms  "
                    f"paths {row['paths']}",
                    flush=True,
                )
    report(rows, args, table(rows), "")


if __name__ == "__main__":
    main()

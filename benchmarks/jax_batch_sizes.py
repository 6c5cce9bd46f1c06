"""What a new batch size costs a step on the JAX backend: one trace and compile.

Keras' JAX trainer compiles its step for each shape of batch it meets, and so does the
tracked (or private) step. Poisson sampling (`kgt.privacy.poisson_batches`) draws a new
batch size at almost every step of the first epochs (about `8 sqrt(q N)` sizes lie
within 4 standard deviations of `q N`), so each new size costs a compile until most have
been seen. For each model of `zoo.py`: the milliseconds of a one-batch `fit` at a batch
size already seen and at new ones, plain `keras.Model` and after `make_private` (sigma 1),
and how many seconds the compiles of the sizes within 4 standard deviations would take.
Imports no TensorFlow.

```
KERAS_BACKEND=jax python benchmarks/jax_batch_sizes.py                      # mlp, transformer
KERAS_BACKEND=jax python benchmarks/jax_batch_sizes.py --models cnn --batch-size 64
```
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

NEW_SIZES = 4  # new batch sizes timed per variant (each a compile)
SEEN_REPEATS = 3  # one-batch fits at a size already compiled


def one_batch_fit_ms(model: Any, name: str, batch_size: int) -> float:
    """Milliseconds of `fit` over one batch of `batch_size` synthetic examples."""
    import jax
    from zoo import synthetic_batches

    x, y = synthetic_batches(name, batch_size, 1)
    begin = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    jax.block_until_ready([v.value for v in model.trainable_variables])
    return 1000 * (time.perf_counter() - begin)


def measure(name: str, batch_size: int) -> list[dict[str, Any]]:
    """Per variant (plain, private): a seen size's fit and a new size's, in ms."""
    import keras
    from zoo import build_compiled

    import keras_gradtrack as kgt

    plain = build_compiled(name, keras.Model)
    private = build_compiled(name, kgt.GradientTrackingModel)
    private.set_weights(plain.get_weights())
    private.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=batch_size)
    spread = math.sqrt(batch_size)  # Poisson: the deviation of the size is about sqrt(q N)
    new_sizes = [batch_size + round(spread * k) for k in (-2, -1, 1, 2)][:NEW_SIZES]
    rows = []
    for variant, model in (("plain", plain), ("private", private)):
        one_batch_fit_ms(model, name, batch_size)  # compiles the step for this size
        seen = [one_batch_fit_ms(model, name, batch_size) for _ in range(SEEN_REPEATS)]
        new = [one_batch_fit_ms(model, name, size) for size in new_sizes]
        seen_ms, new_ms = statistics.median(seen), statistics.median(new)
        sizes_within = 2 * math.ceil(4 * spread) + 1
        rows.append(
            {
                "model": name,
                "variant": variant,
                "seen_ms": seen_ms,
                "new_ms": new_ms,
                "compiles_s": sizes_within * (new_ms - seen_ms) / 1000,
            }
        )
    return rows


def table(rows: list[dict[str, Any]], batch_size: int) -> str:
    lines = [
        f"| model | variant | one-batch fit, a seen size (ms) | a new size (ms) "
        f"| the compiles of the sizes within 4 sd of {batch_size} (s) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['variant']} | {row['seen_ms']:.0f} | {row['new_ms']:.0f} "
            f"| {row['compiles_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    import jax
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit(f"Expected KERAS_BACKEND=jax. Received: {keras.backend.backend()}")
    rows = [row for name in args.models.split(",") for row in measure(name, args.batch_size)]
    device = jax.devices()[0]
    print(
        f"JAX backend, {device.platform}: {device.device_kind}; expected batch size {args.batch_size}"
    )
    print()
    print(table(rows, args.batch_size))


if __name__ == "__main__":
    main()

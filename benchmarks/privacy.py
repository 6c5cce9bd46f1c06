"""What a private (DP-SGD) step costs beside a plain Keras step, on models of the zoo.

For each model: the median wall-clock time per step of plain `keras.Model.fit` and of
`GradientTrackingModel.fit` after `make_private` (no logger: every step private), timed
in interleaved rounds in one process, and the ratio, and the same for a private step without noise (`noise_multiplier=0`:
the clipping alone); with `--memory`, the peak-memory
growth of a short `fit` of each, each in a fresh process. Prints a markdown table.

```
python benchmarks/privacy.py                                 # mlp, cnn, text, transformer at B=128
python benchmarks/privacy.py --models mlp --rounds 3 --quick # smoke test
python benchmarks/privacy.py --memory                        # + peak RSS growth per variant
python benchmarks/privacy.py --memory --no-timing            # memory alone
python benchmarks/privacy.py --noise-kernel                  # + noise by tf.random.stateless_normal
python benchmarks/privacy.py --models mlp --secure-noise     # + secure_noise=True
python benchmarks/privacy.py --accumulation --models cnn     # logical batches of 4096
python benchmarks/privacy.py --models cnn --cpu              # + process CPU per step
```

`--cpu` adds each variant's process CPU time per step (all threads, the fit's warm-up
steps included), from the same timed fits: on a machine shared with other jobs, what
the step computes shows there more steadily than in its wall time.

`--secure-noise` adds a private step with `make_private(..., secure_noise=True)` (the
noise in float64 from `os.urandom`, a sum of 4 draws: `privacy/secure_noise.py`), timed in
the same interleaved rounds.

`--accumulation` trains private logical batches of `--logical` examples (default 4096)
three ways, each in a fresh process: `k` physical batches of `--batch-size` accumulated
(`make_private(accumulation_steps=k)`), one physical batch of the logical size, and one
physical batch of `--batch-size` alone (its memory is the target); it prints each one's
peak-RSS growth over the process's baseline before `fit` and its seconds per logical batch.

`--noise-kernel` adds a private step whose noise is drawn by TensorFlow's own
`tf.random.stateless_normal` kernel instead of `clipping.standard_normal` (the same
Box-Muller transform, vectorized), timed in the same interleaved rounds: a paired
comparison of the two draws on a busy machine.

The "noise draw alone" column times, in the same rounds, a compiled function that draws
one step's noise for the model's trainable variables and nothing else
(`clipping.standard_normal`, one draw per variable, as the step does); "clip + draw"
is (clip only + draw alone) / plain, what the private step would cost if the draw ran
beside nothing: the bound the private step is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import tensorflow as tf
from report import StepTimes
from zoo import ZOO, build_compiled, synthetic_batches

import keras_gradtrack as kgt
from keras_gradtrack.engine import clipping

DEFAULT_MODELS = ("mlp", "cnn", "text", "transformer")
# "clip_only": a private step with noise_multiplier=0, to tell the noise's draw apart.
VARIANTS = ("plain", "private", "clip_only")
# "tf_kernel": a private step drawing its noise with tf.random.stateless_normal.
KERNEL_VARIANT = "tf_kernel"
# "secure": a private step with secure_noise=True.
SECURE_VARIANT = "secure"
WARMUP_STEPS = 2  # dropped at the start of every timed `fit`
# `time_model`'s key of a variant's process CPU seconds per step (`--cpu`).
CPU_PREFIX = "cpu:"


def build(name: str, variant: str, accumulation_steps: int = 1) -> Any:
    model = build_compiled(name, keras.Model if variant == "plain" else kgt.GradientTrackingModel)
    if variant != "plain":
        model.make_private(
            l2_norm_clip=1.0,
            noise_multiplier=0.0 if variant == "clip_only" else 1.0,
            secure_noise=variant == SECURE_VARIANT,
            accumulation_steps=accumulation_steps,
        )
    return model


def kernel_normal(shape: Any, seed: Any, scale: Any = 1.0) -> Any:
    """The noise as drawn before `clipping.standard_normal`: TensorFlow's kernel."""
    return tf.random.stateless_normal(shape, seed) * scale


def dataset_of(name: str, batch_size: int) -> Any:
    data = synthetic_batches(name, batch_size)
    return tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat().prefetch(2)


def timed_fit(model: Any, dataset: Any, steps: int) -> list[float]:
    timer = StepTimes()
    model.fit(
        dataset,
        steps_per_epoch=steps + WARMUP_STEPS,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[timer],
    )
    return timer.times[WARMUP_STEPS:]


def time_model(
    name: str, batch_size: int, rounds: int, steps: int, variants: tuple[str, ...] = VARIANTS
) -> dict[str, float]:
    """Median seconds per step of each variant, from interleaved rounds."""
    keras.utils.set_random_seed(0)
    models = {variant: build(name, variant) for variant in variants}
    for variant in variants[1:]:
        models[variant].set_weights(models["plain"].get_weights())
    dataset = dataset_of(name, batch_size)
    for variant, model in models.items():  # traced before the rounds
        if variant == KERNEL_VARIANT:
            with mock.patch.object(clipping, "standard_normal", kernel_normal):
                timed_fit(model, dataset, 1)
        else:
            timed_fit(model, dataset, 1)
    draw = noise_draw(models["plain"])
    times: dict[str, list[float]] = {variant: [] for variant in (*variants, "draw")}
    cpu: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            started = time.process_time()
            times[variant] += timed_fit(models[variant], dataset, steps)
            cpu[variant].append((time.process_time() - started) / (steps + WARMUP_STEPS))
        times["draw"] += timed_draws(draw, steps)
    medians = {variant: statistics.median(found) for variant, found in times.items()}
    medians.update({CPU_PREFIX + v: statistics.median(found) for v, found in cpu.items()})
    return medians


def noise_draw(model: Any) -> Any:
    """A compiled function drawing one step's noise for `model`'s trainable variables."""
    shapes = [tuple(v.shape) for v in model.trainable_variables]

    @tf.function
    def draw(seed: tf.Tensor) -> list[tf.Tensor]:
        return [
            clipping.standard_normal(shape, tf.random.experimental.stateless_fold_in(seed, i))
            for i, shape in enumerate(shapes)
        ]

    return draw


def timed_draws(draw: Any, count: int) -> list[float]:
    """Seconds of each of `count` draws (after one untimed), each waited for."""
    seed = tf.constant([0, 0], tf.int64)
    draw(seed)[0].numpy()
    found = []
    for step in range(count):
        started = time.perf_counter()
        draw(seed + step)[0].numpy()
        found.append(time.perf_counter() - started)
    return found


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (`VmRSS`: now, `VmHWM`: the peak), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Sets the peak (VmHWM) to the current RSS (Linux: `clear_refs` 5)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def memory_child(name: str, variant: str, batch_size: int) -> None:
    """Prints the peak-RSS growth of a short `fit` (after the model and data exist)."""
    keras.utils.set_random_seed(0)
    model = build(name, variant)
    dataset = dataset_of(name, batch_size)
    reset_peak_rss()  # TensorFlow's start-up peak is not the fit's
    before = status_mib("VmRSS")
    model.fit(dataset, steps_per_epoch=6, epochs=1, verbose=0, shuffle=False)
    print(json.dumps({"growth_mib": status_mib("VmHWM") - before}))


def accumulation_child(name: str, batch_size: int, accumulation_steps: int) -> None:
    """Prints the peak-RSS growth and the seconds per logical batch of a private `fit`
    of 2 logical batches (after the model and data exist; the first is traced)."""
    keras.utils.set_random_seed(0)
    model = build(name, "private", accumulation_steps)
    data = synthetic_batches(name, batch_size, num_batches=1)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat()
    reset_peak_rss()
    before = status_mib("VmRSS")
    started = time.perf_counter()
    model.fit(dataset, steps_per_epoch=accumulation_steps, epochs=1, verbose=0, shuffle=False)
    traced = time.perf_counter()
    model.fit(dataset, steps_per_epoch=accumulation_steps, epochs=1, verbose=0, shuffle=False)
    seconds = time.perf_counter() - traced
    assert model.private_steps == 2, model.privacy_history
    growth = status_mib("VmHWM") - before
    print(json.dumps({"growth_mib": growth, "seconds": seconds, "first": traced - started}))


def accumulation_table(names: list[str], batch_size: int, logical: int) -> None:
    """Peak growth and seconds per logical batch: accumulated, one big batch, one small."""
    if logical % batch_size:
        raise SystemExit(f"Expected --logical a multiple of --batch-size. Received: {logical}")
    k = logical // batch_size
    print(f"# logical batch {logical}: k={k} x {batch_size} accumulated vs one batch")
    rows = [
        "| model | variant | physical batch | peak growth (MiB) | s per logical batch |",
        "| --- | --- | --- | --- | --- |",
    ]
    variants = (
        (f"{k} x {batch_size} accumulated", batch_size, k),
        (f"1 x {logical}", logical, 1),
        (f"1 x {batch_size} (a logical batch of {batch_size})", batch_size, 1),
    )
    for name in names:
        for label, size, steps in variants:
            command = [
                sys.executable,
                __file__,
                "--accumulation-child",
                name,
                str(size),
                str(steps),
            ]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            found = json.loads(output.strip().splitlines()[-1])
            row = (
                f"| {name} | {label} | {size} | {found['growth_mib']:.0f} | "
                f"{found['seconds']:.2f} |"
            )
            rows.append(row)
            print(row, flush=True)
    print("\n".join(rows))


def memory_growth(name: str, variant: str, batch_size: int) -> float:
    command = [sys.executable, __file__, "--child", name, variant, str(batch_size)]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(json.loads(output.strip().splitlines()[-1])["growth_mib"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 steps")
    parser.add_argument("--memory", action="store_true", help="peak RSS growth per variant")
    parser.add_argument("--no-timing", action="store_true", help="with --memory: memory alone")
    parser.add_argument(
        "--noise-kernel", action="store_true", help="+ noise by tf.random.stateless_normal"
    )
    parser.add_argument(
        "--secure-noise", action="store_true", help="+ a private step with secure_noise=True"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="+ process CPU ms per step (plain, private, clip)"
    )
    parser.add_argument("--accumulation", action="store_true", help="logical batches")
    parser.add_argument("--logical", type=int, default=4096, help="with --accumulation")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.accumulation_child:
        name, size, steps = args.accumulation_child
        accumulation_child(name, int(size), int(steps))
        return
    if args.accumulation:
        accumulation_table(args.models.split(","), args.batch_size, args.logical)
        return
    if args.child:
        name, variant, batch_size = args.child
        memory_child(name, variant, int(batch_size))
        return
    rounds, steps = (2, 3) if args.quick else (args.rounds, args.steps)
    print(
        f"# {os.cpu_count()} CPUs, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"B={args.batch_size}, {rounds} interleaved rounds of {steps} steps, medians"
    )
    header = (
        "| model | plain step (ms) | private step (ms) | ratio | clip only (ms) | ratio "
        "| noise draw alone (ms) | clip + draw |"
    )
    rule = "| --- | --- | --- | --- | --- | --- | --- | --- |"
    variants = VARIANTS + ((KERNEL_VARIANT,) if args.noise_kernel else ())
    variants += (SECURE_VARIANT,) if args.secure_noise else ()
    if args.noise_kernel:
        header += " private, noise by TF's kernel (ms) | ratio |"
        rule += " --- | --- |"
    if args.secure_noise:
        header += " private, secure noise (ms) | ratio |"
        rule += " --- | --- |"
    if args.cpu:
        header += " CPU plain / private / clip only (ms) | ratios |"
        rule += " --- | --- |"
    if args.memory:
        header += " plain peak growth (MiB) | private | clip only |"
        rule += " --- | --- | --- |"
    rows = [header, rule]
    for name in args.models.split(","):
        if name not in ZOO:
            raise SystemExit(f"Expected models among {sorted(ZOO)}. Received: {name!r}")
        if args.no_timing:
            medians = dict.fromkeys((*variants, "draw"), float("nan"))
        else:
            medians = time_model(name, args.batch_size, rounds, steps, variants)
        row = (
            f"| {name} | {medians['plain'] * 1e3:.1f} | {medians['private'] * 1e3:.1f} | "
            f"{medians['private'] / medians['plain']:.2f}x | "
            f"{medians['clip_only'] * 1e3:.1f} | {medians['clip_only'] / medians['plain']:.2f}x | "
            f"{medians['draw'] * 1e3:.2f} | "
            f"{(medians['clip_only'] + medians['draw']) / medians['plain']:.2f}x |"
        )
        if args.noise_kernel:
            kernel = medians[KERNEL_VARIANT]
            row += f" {kernel * 1e3:.1f} | {kernel / medians['plain']:.2f}x |"
        if args.secure_noise:
            secure = medians[SECURE_VARIANT]
            row += f" {secure * 1e3:.1f} | {secure / medians['plain']:.2f}x |"
        if args.cpu:
            found = [medians[CPU_PREFIX + v] for v in VARIANTS]
            row += " " + " / ".join(f"{c * 1e3:.1f}" for c in found) + " | "
            row += " / ".join(f"{c / found[0]:.2f}x" for c in found[1:]) + " |"
        if args.memory:
            row += "".join(f" {memory_growth(name, v, args.batch_size):.0f} |" for v in VARIANTS)
        rows.append(row)
        print(row, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

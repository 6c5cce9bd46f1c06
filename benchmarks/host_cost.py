"""What a tracked `fit` pays beyond the math: per-step host work, several steps per call,
norm-only statistics, short fits.

For each model, in interleaved rounds (each variant's ratio is paired with plain's in
the same round, so load drift cancels), every variant runs a whole `fit` of `--steps`
steps (traced before the rounds) on the same batches, and a step's time is the
median of its fit's calls (`on_train_batch_begin` to `on_train_batch_end`; a call of
`steps_per_execution=16` counts as 16 steps):

* `plain`, `plain_spe16`: `keras.Model`, `steps_per_execution` 1 and 16;
* `tracked`: `HDF5GradientLogger` with the default statistics;
* `tracked_fg`: the same with its blocks written on the training thread (as before the
  logger's writer thread), for `host ms, blocks in the training thread` and
  `tracked_fg / plain`;
* `norms`: the logger with `statistics=["loss", "grad_norm", "layer_grad_norm"]`;
* `tracked_spe16`: the default logger with `steps_per_execution=16` (paired with
  `plain_spe16`);
* `fit of 16`: the wall time of a whole `fit` of 16 steps, tracked over plain: the
  logger's open and close, the example-independence guard and the first-step checks
  included (a fresh logger file each time; tf.data autotuning off in every variant);
  `fit of 16, guard` the same with the guard run again (as every `fit` did before it
  ran once per model, loss and batch signature) and the blocks on the training thread.

`host ms/step` is the time each tracked step spends in Python after its compiled call
(the model's reports to its loggers, the logger's rows, its blocks written to the file).
`CPU: ...` are ratios of the process's CPU time (all its threads) over whole fits of
`--steps` steps (tracked) and of 16 steps (fit of 16), less disturbed by other processes
than wall times, and counting the writer thread's work that wall times may hide.

```
python benchmarks/host_cost.py                        # mlp, cnn, text; ~5 min
python benchmarks/host_cost.py --models mlp --rounds 9
python benchmarks/host_cost.py --gil   # does h5py release the GIL while it compresses?
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import tensorflow as tf
from report import StepTimes
from zoo import ZOO, build_compiled, synthetic_batches

import keras_gradtrack as kgt
from keras_gradtrack.engine import schedule

NORMS = ["loss", "grad_norm", "layer_grad_norm"]
MILLISECONDS = {"plain ms", "host ms/step", "host ms/step fg", "plain spe16 ms"}


class ForegroundLogger(kgt.HDF5GradientLogger):
    """The logger with its blocks written on the training thread."""

    def _open_writer(self) -> None:
        super()._open_writer()
        assert self.writer is not None
        self.writer.background = False


class HostTimer:
    """Adds up the time the model's reports to its subscribers take."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self._report = schedule.GradientTrackingState.report

        def timed(state: Any, *args: Any, **kwargs: Any) -> None:
            began = time.perf_counter()
            self._report(state, *args, **kwargs)
            self.seconds += time.perf_counter() - began
            self.steps += 1

        schedule.GradientTrackingState.report = timed  # type: ignore[method-assign]

    def take(self) -> float:
        """Milliseconds per step since the last call."""
        per_step = 1e3 * self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        return per_step


def variants(name: str, folder: str) -> dict[str, tuple[Any, Callable[[], list[Any]]]]:
    """Variant -> (model, the callbacks of one fit)."""
    models = {
        "plain": build_compiled(name, keras.Model),
        "plain_spe16": build_compiled(name, keras.Model, steps_per_execution=16),
        "tracked": build_compiled(name, kgt.GradientTrackingModel),
        "tracked_fg": build_compiled(name, kgt.GradientTrackingModel),
        "norms": build_compiled(name, kgt.GradientTrackingModel),
        "tracked_spe16": build_compiled(name, kgt.GradientTrackingModel, steps_per_execution=16),
    }
    weights = models["plain"].get_weights()
    for model in models.values():
        model.set_weights(weights)
    counter = iter(range(10**9))

    def logger(kind: type = kgt.HDF5GradientLogger, **kwargs: Any) -> Callable[[], list[Any]]:
        return lambda: [kind(f"{folder}/{next(counter)}.h5", **kwargs)]

    return {
        "plain": (models["plain"], list),
        "tracked": (models["tracked"], logger()),
        "tracked_fg": (models["tracked_fg"], logger(ForegroundLogger)),
        "norms": (models["norms"], logger(statistics=NORMS)),
        "plain_spe16": (models["plain_spe16"], list),
        "tracked_spe16": (models["tracked_spe16"], logger()),
    }


def fit_times(
    model: Any, dataset: Any, steps: int, callbacks: list[Any]
) -> tuple[float, float, list[float]]:
    """One `fit`: its wall time, the process's CPU time (all threads: TensorFlow's, the
    log's writer) and each call's time (`StepTimes`), in seconds."""
    times = StepTimes()
    began, began_cpu = time.perf_counter(), time.process_time()
    model.fit(
        dataset, steps_per_epoch=steps, verbose=0, callbacks=[*callbacks, times], shuffle=False
    )
    return time.perf_counter() - began, time.process_time() - began_cpu, times.times


def measure(name: str, batch_size: int, steps: int, rounds: int) -> dict[str, Any]:
    x, y = synthetic_batches(name, batch_size)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat()
    # Without autotuning: TensorFlow's wait when it deletes an autotuned iterator at the
    # end of a fit (60 to 170 ms, docs/performance.md) would swamp a short fit.
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = dataset.with_options(options)
    timer = HostTimer()
    with tempfile.TemporaryDirectory() as folder:
        runs = variants(name, folder)
        for model, callbacks in runs.values():  # trace every step function
            fit_times(model, dataset, 32, callbacks())
        timer.take()
        per_step: dict[str, list[float]] = {v: [] for v in runs}
        host: dict[str, list[float]] = {v: [] for v in runs}
        short: dict[str, list[float]] = {"plain": [], "tracked": [], "tracked_fg": []}
        short_cpu: dict[str, list[float]] = {v: [] for v in short}
        fit_cpu: dict[str, list[float]] = {v: [] for v in runs}
        for _ in range(rounds):
            for variant, (model, callbacks) in runs.items():
                _, cpu, calls = fit_times(model, dataset, steps, callbacks())
                fit_cpu[variant].append(cpu)
                per_call = statistics.median(calls[1:])  # the first call waits for data
                per_step[variant].append(per_call / (16 if variant.endswith("spe16") else 1))
                host[variant].append(timer.take())
            for variant in short:
                model, callbacks = runs[variant]
                if variant == "tracked_fg":
                    model.__dict__.pop("_independent_batches", None)
                wall, cpu, _ = fit_times(model, dataset, 16, callbacks())
                short[variant].append(wall)
                short_cpu[variant].append(cpu)
            timer.take()

    def paired(variant: str, base: str, table: dict[str, list[float]]) -> float:
        return statistics.median(a / b for a, b in zip(table[variant], table[base]))

    return {
        "plain ms": 1e3 * statistics.median(per_step["plain"]),
        "tracked": paired("tracked", "plain", per_step),
        "tracked_fg": paired("tracked_fg", "plain", per_step),
        "norms": paired("norms", "plain", per_step),
        "host ms/step": statistics.median(host["tracked"]),
        "host ms/step fg": statistics.median(host["tracked_fg"]),
        "plain spe16 ms": 1e3 * statistics.median(per_step["plain_spe16"]),
        "tracked spe16": paired("tracked_spe16", "plain_spe16", per_step),
        "fit of 16": paired("tracked", "plain", short),
        "fit of 16, guard": paired("tracked_fg", "plain", short),
        "CPU: tracked": paired("tracked", "plain", fit_cpu),
        "CPU: tracked_fg": paired("tracked_fg", "plain", fit_cpu),
        "CPU: fit of 16": paired("tracked", "plain", short_cpu),
        "CPU: fit of 16, guard": paired("tracked_fg", "plain", short_cpu),
    }


def gil_check(rows: int = 2_000_000) -> None:
    """Prints how fast a pure-Python loop runs beside one large gzip write on another
    thread, beside a sleeping thread and beside one C call that holds the GIL: if h5py
    held the GIL while HDF5 compresses and writes, the first would be as slow as the last
    (with a free core it runs as fast as the second)."""
    import threading

    import h5py
    import numpy as np

    values = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder, h5py.File(f"{folder}/a.h5", "w") as file:
        dataset = file.create_dataset(
            "d", (0, 4), maxshape=(None, 4), chunks=(4096, 4), dtype="f4",
            compression="gzip", compression_opts=4, shuffle=True,
        )  # fmt: skip

        def write() -> None:
            dataset.resize(dataset.shape[0] + rows, axis=0)
            dataset[-rows:] = values
            file.flush()

        def loop_rate(work: Callable[[], Any]) -> tuple[float, float]:
            thread = threading.Thread(target=work)
            began, count = time.perf_counter(), 0
            thread.start()
            while thread.is_alive():
                count += 1
            seconds = time.perf_counter() - began
            return count / seconds, seconds

        began = time.perf_counter()
        write()
        alone = time.perf_counter() - began
        rates = {
            "a gzip write": loop_rate(write),
            "a sleeping thread": loop_rate(lambda: time.sleep(alone)),
            "a C call holding the GIL (sum of a range)": loop_rate(lambda: sum(range(10 * rows))),
        }
    print(f"the write alone: {1e3 * alone:.0f} ms")
    for name, (rate, seconds) in rates.items():
        print(f"loop beside {name}: {rate / 1e6:.2f} M/s ({1e3 * seconds:.0f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn,text")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="steps per timed fit (64)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gil", action="store_true", help="only the GIL check")
    args = parser.parse_args()
    if args.gil:
        return gil_check()
    keras.utils.set_random_seed(0)
    rows = {
        name: measure(name, args.batch_size, args.steps, args.rounds)
        for name in args.models.split(",")
    }
    columns = list(next(iter(rows.values())))
    print(f"B={args.batch_size}, {args.steps} steps per fit, {args.rounds} rounds; ratios to plain")
    print("| model | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for name, row in rows.items():
        cells = [f"{v:.2f}" if k in MILLISECONDS else f"{v:.2f}x" for k, v in row.items()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    assert all(name in ZOO for name in rows)


if __name__ == "__main__":
    main()

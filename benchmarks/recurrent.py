"""Recurrent layers: what exact per-example statistics cost in `fit`, and what they replace.

For each model, the time per training step of plain `keras.Model.fit`, of
`GradientTrackingModel.fit` with `HDF5GradientLogger` (every step: the recurrent rule),
of the path before that rule (`unroll=True`, every cell on the per-layer fallback) and
of a per-example `GradientTape` loop; and the peak-memory growth of plain and tracked
`fit`. Prints the machine, each model's tracking plan and a markdown table.

```
python benchmarks/recurrent.py                    # imdb and gru, B = 128
python benchmarks/recurrent.py --quick            # smoke test: short sequences, 1 round
python benchmarks/recurrent.py --models imdb --rounds 9 --out benchmarks/results/rnn.md
python benchmarks/recurrent.py --no-timing        # the memory columns only
```

Models (synthetic data of the real sizes; Adam):

* `imdb`: keras-io `bidirectional_lstm_imdb`: Embedding(20000, 128) -> Bidirectional(
  LSTM(64, return_sequences=True)) -> Bidirectional(LSTM(64)) -> Dense(1, sigmoid),
  200 token ids, binary cross-entropy.
* `gru`: Embedding(20000, 128) -> GRU(64, return_sequences=True) -> GRU(64) -> Dense(1,
  sigmoid), 200 token ids, binary cross-entropy.
* `weather` (not run by default): keras-io `timeseries_weather_forecasting`: LSTM(32) ->
  Dense(1) on 120 steps of 7 features, mean squared error.

Timing: one child process per model runs every variant in interleaved rounds; each
ratio is the median over rounds of the round's time over plain's (paired, so load drift
cancels). The slow baselines run one step in the first round only. Memory: a fresh
process per (model, variant): peak RSS during a `fit` of a few steps (tracing included)
minus the RSS just before it (model built, data in memory).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from baselines import make_tape_loop_step
from overhead import progress
from report import device_description, machine_lines, number, print_and_save

import keras_gradtrack as kgt

MODELS = ("imdb", "gru", "weather")
DEFAULT_MODELS = ("imdb", "gru")
VARIANTS = ("plain", "tracked", "unroll_fallback", "tape_loop")
SLOW_BASELINES = ("unroll_fallback", "tape_loop")
RECURRENT_CLASSES = (keras.layers.RNN, keras.layers.SimpleRNN, keras.layers.LSTM, keras.layers.GRU)
MESSAGE_PREFIX = "@@recurrent "


WARMUP_STEPS = 2  # dropped from each timed fit (the first traces the step)


class StepStart(keras.callbacks.Callback):
    """First in the callback list: notes when each step begins."""

    def __init__(self) -> None:
        super().__init__()
        self.begins: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.begins.append(time.perf_counter())


class StepEnd(keras.callbacks.Callback):
    """Last in the callback list (after the logger has written): step durations."""

    def __init__(self, start: StepStart) -> None:
        super().__init__()
        self.start = start
        self.seconds: list[float] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self.start.begins[-1])


def fit_step_seconds(model: Any, dataset: Any, steps: int, callbacks: list[Any]) -> list[float]:
    """Per-step times of one `fit` of `steps` steps, after `WARMUP_STEPS` dropped ones."""
    start = StepStart()
    end = StepEnd(start)
    total = WARMUP_STEPS + steps
    model.fit(dataset, steps_per_epoch=total, verbose=0, callbacks=[start, *callbacks, end])
    return end.seconds[WARMUP_STEPS:]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- models and data ------------------------------------------------------------------


def build_model(name: str, model_class: type, length: int, unroll: bool = False) -> Any:
    """The named model, compiled with Adam and its loss."""
    layers = keras.layers
    if name == "weather":
        inputs = keras.Input((length, 7))
        outputs = layers.Dense(1)(layers.LSTM(32, unroll=unroll)(inputs))
        loss = keras.losses.MeanSquaredError()
    else:
        inputs = keras.Input((length,), dtype="int32")
        hidden = layers.Embedding(20000, 128)(inputs)
        if name == "imdb":
            hidden = layers.Bidirectional(layers.LSTM(64, return_sequences=True, unroll=unroll))(
                hidden
            )
            hidden = layers.Bidirectional(layers.LSTM(64, unroll=unroll))(hidden)
        else:
            hidden = layers.GRU(64, return_sequences=True, unroll=unroll)(hidden)
            hidden = layers.GRU(64, unroll=unroll)(hidden)
        outputs = layers.Dense(1, activation="sigmoid")(hidden)
        loss = keras.losses.BinaryCrossentropy()
    model = model_class(inputs, outputs, name=name)
    model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
    return model


def synthetic_data(name: str, batch_size: int, length: int, num_batches: int = 4) -> Any:
    rng = np.random.default_rng(0)
    size = batch_size * num_batches
    if name == "weather":
        x = rng.standard_normal((size, length, 7), dtype=np.float32)
        return x, rng.standard_normal((size, 1), dtype=np.float32)
    x = rng.integers(0, 20000, (size, length), dtype=np.int32)
    return x, rng.integers(0, 2, (size, 1)).astype(np.float32)


def repeated_dataset(name: str, batch_size: int, length: int) -> Any:
    data = synthetic_data(name, batch_size, length)
    return tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat().prefetch(2)


@contextlib.contextmanager
def without_recurrent_rule() -> Iterator[None]:
    """The registry before the recurrent rule: recurrent layers own no variables, their
    cells are columns of their own (on the fallback, which needs `unroll=True`)."""
    previous = [kgt.register_rule(cls, None) for cls in RECURRENT_CLASSES]
    try:
        yield
    finally:
        for cls, rule in zip(RECURRENT_CLASSES, previous):
            kgt.register_rule(cls, rule)


# -- the timing child -----------------------------------------------------------------


def timed_variants(
    spec: dict[str, Any], wanted: list[str], log_dir: str
) -> dict[str, Callable[[int], float]]:
    """Per wanted variant: seconds per step over `n` steps (the first call traces)."""
    name, batch_size, length = spec["model"], spec["batch_size"], spec["length"]
    keras.utils.set_random_seed(0)
    plain = build_model(name, keras.Model, length)
    dataset = repeated_dataset(name, batch_size, length)
    paths = (os.path.join(log_dir, f"{name}_{i}.h5") for i in range(10**9))

    def fit_seconds(model: Any, tracked_fit: bool) -> Callable[[int], float]:
        def seconds(steps: int) -> float:
            loggers = [kgt.HDF5GradientLogger(next(paths))] if tracked_fit else []
            return statistics.median(fit_step_seconds(model, dataset, steps, loggers))

        return seconds

    def like_plain(model: Any) -> Any:
        model.set_weights(plain.get_weights())
        return model

    variants: dict[str, Callable[[int], float]] = {}
    if "plain" in wanted:
        variants["plain"] = fit_seconds(plain, False)
    if "tracked" in wanted:
        tracked = like_plain(build_model(name, kgt.GradientTrackingModel, length))
        variants["tracked"] = fit_seconds(tracked, True)
    if "unroll_fallback" in wanted:
        unrolled = like_plain(build_model(name, kgt.GradientTrackingModel, length, unroll=True))
        fallback_seconds = fit_seconds(unrolled, True)

        def unroll_fallback(steps: int) -> float:
            with without_recurrent_rule():  # the step is traced on its first call
                return fallback_seconds(steps)

        variants["unroll_fallback"] = unroll_fallback
    if "tape_loop" in wanted:
        reference = like_plain(build_model(name, keras.Model, length))
        optimizer = keras.optimizers.Adam()
        optimizer.build(reference.trainable_variables)
        step = make_tape_loop_step(reference, reference.loss, optimizer)
        x, y = next(iter(dataset))

        def tape_loop(steps: int) -> float:
            times = []
            for _ in range(steps):
                begin = time.perf_counter()
                for output in step(x, y):
                    output.numpy()
                times.append(time.perf_counter() - begin)
            return statistics.median(times)

        variants["tape_loop"] = tape_loop
    return variants


def run_timing_child(spec: dict[str, Any]) -> None:
    """Plain and tracked `fit` in interleaved rounds, then the tracked model's plan."""
    name = spec["model"]
    wanted = [v for v in spec["variants"] if v not in SLOW_BASELINES]
    with tempfile.TemporaryDirectory(prefix="recurrent-") as log_dir:
        variants = timed_variants(spec, wanted, log_dir)
        rounds: dict[str, list[float]] = {key: [] for key in variants}
        for round_index in range(-1, spec["rounds"]):  # round -1 traces
            for key, seconds in variants.items():
                emit({"stage": [key, round_index]})
                started = time.perf_counter()
                value = seconds(1 if round_index < 0 else spec["steps"])
                if round_index < 0:
                    emit({"traced": [key, time.perf_counter() - started]})
                else:
                    rounds[key].append(value)
            gc.collect()
        emit({"rounds": rounds})
    model = build_model(name, kgt.GradientTrackingModel, spec["length"])
    x, y = synthetic_data(name, 8, spec["length"], num_batches=1)
    model.gradient_statistics(x, y)  # traces a step: the summary shows each form
    emit({"summary": model.gradient_tracking_summary(print_fn=lambda _: None)})


def run_baseline_child(spec: dict[str, Any]) -> None:
    """One slow baseline: its first step (tracing), then the median of a few steps."""
    key = spec["baseline"]
    with tempfile.TemporaryDirectory(prefix="recurrent-") as log_dir:
        seconds = timed_variants(spec, [key], log_dir)[key]
        emit({"stage": [key, -1]})
        started = time.perf_counter()
        seconds(1)
        emit({"traced": [key, time.perf_counter() - started]})
        emit({"stage": [key, 0]})
        emit({"rounds": {key: [seconds(spec["baseline_steps"])]}})


# -- the memory child -----------------------------------------------------------------


def run_memory_child(spec: dict[str, Any]) -> None:
    """Peak RSS growth of a `fit` over the RSS just before it, in a fresh process."""
    name, tracked = spec["model"], spec["variant"] == "tracked"
    model_class = kgt.GradientTrackingModel if tracked else keras.Model
    model = build_model(name, model_class, spec["length"])
    dataset = repeated_dataset(name, spec["batch_size"], spec["length"])
    next(iter(dataset))
    with tempfile.TemporaryDirectory(prefix="recurrent-") as log_dir:
        callbacks = [kgt.HDF5GradientLogger(os.path.join(log_dir, "run.h5"))] if tracked else []
        gc.collect()
        before = rss_mib()
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the peak mark (ru_maxrss) restarts from here
        model.fit(dataset, steps_per_epoch=spec["memory_steps"], verbose=0, callbacks=callbacks)
        peak = peak_rss_mib()
    emit({"memory": [before, peak, peak - before]})


# -- the parent -----------------------------------------------------------------------


def emit(message: dict[str, Any]) -> None:
    print(MESSAGE_PREFIX + json.dumps(message), flush=True)


def run_child(
    spec: dict[str, Any],
    on_message: Callable[[dict[str, Any]], None],
    timeout_minutes: float | None = None,
) -> str | None:
    """Runs this script as a child on `spec`, passing on its messages; why it failed."""
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    deadline = None if timeout_minutes is None else time.monotonic() + 60 * timeout_minutes
    with tempfile.TemporaryFile("w+") as stderr, tempfile.TemporaryFile("w+") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
        read = 0
        while True:
            try:
                process.wait(timeout=1.0)
                done = True
            except subprocess.TimeoutExpired:
                done = False
            stdout.seek(read)
            for line in stdout.readlines():
                if line.startswith(MESSAGE_PREFIX):
                    on_message(json.loads(line[len(MESSAGE_PREFIX) :]))
            read = stdout.tell()
            if done:
                break
            if deadline is not None and time.monotonic() > deadline:
                process.kill()
                process.wait()
                return f"stopped after {timeout_minutes:.0f} min"
        if process.returncode != 0:
            stderr.seek(0)
            tail = stderr.read()[-3000:]
            progress(f"child {spec['kind']} {spec['model']} exited {process.returncode}:\n{tail}")
            return f"child exited {process.returncode}"
    return None


def time_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plain and tracked in one child, then each slow baseline in a child of its own."""
    result: dict[str, Any] = {"failures": {}, "traced": {}, "rounds": {}}

    def on_message(message: dict[str, Any]) -> None:
        if "stage" in message:
            key, index = message["stage"]
            progress(f"{name} {key} {'first step' if index < 0 else f'round {index + 1}'}")
        elif "traced" in message:
            result["traced"][message["traced"][0]] = message["traced"][1]
        elif "rounds" in message:
            result["rounds"].update(message["rounds"])
        else:
            result.update(message)

    spec = {**vars(args), "kind": "timing", "model": name}
    failure = run_child(spec, on_message)
    for key in ("plain", "tracked"):
        if failure and key not in result["rounds"]:
            result["failures"][key] = failure
    for key in SLOW_BASELINES:
        if key in args.variants:
            spec = {**vars(args), "kind": "baseline", "model": name, "baseline": key}
            failure = run_child(spec, on_message, args.baseline_timeout)
            if failure:
                result["failures"][key] = failure
    return result


def measure_memory(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    def one(key: tuple[str, str]) -> Any:
        found: dict[str, Any] = {}
        spec = {**vars(args), "kind": "memory", "model": key[0], "variant": key[1]}
        run_child(spec, found.update)
        progress(f"memory {key[0]} {key[1]} done")
        return found.get("memory")

    keys = [(name, variant) for name in args.models for variant in ("plain", "tracked")]
    # One at a time: two children side by side would share the two cores and the memory.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return dict(zip(keys, pool.map(one, keys)))


HEADER = (
    "| model | B | T | plain ms/step | tracked ms/step | tracked / plain | unroll+fallback "
    "ms/step | unroll+fallback / plain | tape loop ms/step | loop / plain | plain growth MiB "
    "| tracked growth MiB | memory ratio |"
)


def table_row(name: str, args: argparse.Namespace, timing: dict[str, Any], memory: Any) -> str:
    rounds = timing.get("rounds", {})
    plain = rounds.get("plain", [])
    cells = [name, str(args.batch_size), str(sequence_length(name, args.length))]
    cells.append(number(statistics.median(plain) * 1e3) if plain else "-")
    for variant in VARIANTS[1:]:
        times = rounds.get(variant, [])
        if variant in timing["failures"]:
            cells += [timing["failures"][variant], "-"]
        elif not times or not plain:
            cells += ["-", "-"]
        elif variant in SLOW_BASELINES:
            median = statistics.median(times)
            cells += [number(median * 1e3), number(median / statistics.median(plain)) + "x"]
        else:
            paired = [t / p for t, p in zip(times, plain)]
            cells += [
                number(statistics.median(times) * 1e3),
                number(statistics.median(paired)) + "x",
            ]
    growth = [memory.get((name, v)) for v in ("plain", "tracked")]
    growth = [g[2] if g else None for g in growth]
    cells += [number(g) if g is not None else "-" for g in growth]
    cells.append(
        number(growth[1] / growth[0]) + "x" if None not in growth and growth[0] > 0 else "-"
    )
    return "| " + " | ".join(cells) + " |"


def report(args: argparse.Namespace, timings: dict[str, Any], memory: dict[Any, Any]) -> str:
    lines = ["# keras_gradtrack recurrent benchmark", "", *machine_lines(device_description()), ""]
    lines.append(
        f"Plain and tracked: {args.rounds} interleaved rounds of {args.steps} fit steps "
        "each, in one process (the median step per round); their ratio is the median over "
        "rounds of each round's tracked time over plain's. The unroll+fallback and tape "
        f"loop: the median of {args.baseline_steps} steps after the first, each in a "
        "process of its own; their ratios are over plain's median. Memory: peak RSS growth "
        f"over the RSS before a {args.memory_steps}-step fit, a fresh process each."
    )
    for name, timing in timings.items():
        traced = ", ".join(f"{k} {v:.0f} s" for k, v in timing.get("traced", {}).items())
        lines += ["", f"## {name}", ""]
        if traced:
            lines += [f"First step (tracing included): {traced}", ""]
        lines += ["```", timing.get("summary", "(no plan: the child failed)"), "```"]
    lines += ["", "## Results", "", HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    lines += [table_row(name, args, timing, memory) for name, timing in timings.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def names(text: str, allowed: tuple[str, ...]) -> list[str]:
        chosen = [name for name in text.split(",") if name]
        unknown = [name for name in chosen if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"Expected names in {allowed}. Received: {unknown}")
        return chosen

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=lambda t: names(t, MODELS), default=list(DEFAULT_MODELS))
    parser.add_argument("--variants", type=lambda t: names(t, VARIANTS), default=list(VARIANTS))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--length", type=int, help="sequence length (200; weather 120)")
    parser.add_argument("--steps", type=int, default=5, help="timed fit steps per round (5)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps of the memory fit")
    parser.add_argument(
        "--baseline-steps", type=int, default=2, help="timed steps of a slow baseline (2)"
    )
    parser.add_argument(
        "--baseline-timeout",
        type=float,
        default=60.0,
        help="minutes before a slow baseline's child is stopped (60; its tracing grows "
        "with the sequence length when unrolled)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory columns")
    parser.add_argument(
        "--no-timing",
        action="store_true",
        help="skip the time columns (memory does not depend on the machine's load, time does)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: length 20, 1 round")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.rounds, args.steps = args.length or 20, 1, 2
        args.memory_steps = args.baseline_steps = 2
    return args


def sequence_length(name: str, length: int | None) -> int:
    return length or (120 if name == "weather" else 200)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        spec["length"] = sequence_length(spec["model"], spec["length"])
        children = {"memory": run_memory_child, "baseline": run_baseline_child}
        children.get(spec["kind"], run_timing_child)(spec)
        return
    started = time.perf_counter()
    timings = {}
    for name in args.models:
        if args.no_timing:
            timings[name] = {"failures": {}, "traced": {}, "rounds": {}, "summary": "(not timed)"}
            continue
        progress(f"timing {name}")
        timings[name] = time_model(name, args)
    memory = {} if args.no_memory else measure_memory(args)
    text = report(args, timings, memory)
    text += f"\n\nTotal time: {(time.perf_counter() - started) / 60:.1f} min.\n"
    print_and_save(text, args.out)


if __name__ == "__main__":
    main()

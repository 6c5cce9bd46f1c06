"""What exact per-example gradient statistics cost in Keras `fit`, and what they replace.

For each model and batch size: the time per training step of plain `keras.Model.fit`, of
`GradientTrackingModel.fit` with `HDF5GradientLogger` (every step, and every 10th step),
and of the two ways users get the same numbers today (a per-example `GradientTape` loop,
`tape.jacobian`); and the peak-memory growth of plain and tracked `fit`. Prints the
machine, each model's tracking plan and a markdown table (columns: benchmarks/README.md).

```
python benchmarks/overhead.py                      # full run
python benchmarks/overhead.py --quick              # smoke test
python benchmarks/overhead.py --models mlp,cnn --batch-sizes 32,128 --out benchmarks/results/run.md
```

Each model is timed in a child process, and each memory figure comes from a fresh one;
children run under a memory cap, so an out-of-memory configuration becomes a table cell.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
import tensorflow as tf

import keras_gradtrack as kgt

MODELS = ("mlp", "cnn", "text", "transformer")
BATCH_SIZES = (32, 128, 512)
VARIANTS = ("plain", "tracked", "tracked_every_10", "tape_loop", "jacobian")
WARMUP_STEPS = 2  # dropped at the start of every timed `fit` (iterator start-up)
SECONDS_PER_ROUND = 4.0  # a slow variant times fewer steps per round (at least 3)
JACOBIAN_BUDGET_GIB = 6.0
SLOW_BASELINES = ("tape_loop", "jacobian")
BASELINE_ROUNDS = 3  # the slow baselines are timed in the first rounds only
MESSAGE_PREFIX = "@@overhead "  # marks the child's JSON lines among library output


# -- models and data ------------------------------------------------------------------


def build_model(name: str, model_class: type) -> Any:
    """The named functional model (logits, no softmax), built with `model_class`."""
    layers = keras.layers
    if name == "mlp":
        inputs = keras.Input((784,))
        hidden = layers.Dense(256, activation="relu")(inputs)
        hidden = layers.Dense(256, activation="relu")(hidden)
        outputs = layers.Dense(10)(hidden)
    elif name == "cnn":
        inputs = keras.Input((28, 28, 1))
        hidden = layers.Conv2D(32, 3, activation="relu")(inputs)
        hidden = layers.Conv2D(32, 3, activation="relu")(hidden)
        outputs = layers.Dense(10)(layers.Flatten()(hidden))
    elif name == "text":
        inputs = keras.Input((32,), dtype="int32")
        hidden = layers.Embedding(1000, 64)(inputs)
        hidden = layers.Dense(64, activation="relu")(hidden)
        hidden = layers.LayerNormalization()(hidden)
        outputs = layers.Dense(2)(layers.GlobalAveragePooling1D()(hidden))
    else:  # transformer
        inputs = keras.Input((32,), dtype="int32")
        hidden = layers.Embedding(1000, 64)(inputs)
        attended = layers.MultiHeadAttention(num_heads=4, key_dim=16)(hidden, hidden)
        hidden = layers.LayerNormalization()(layers.Add()([hidden, attended]))
        feed_forward = layers.Dense(64)(layers.Dense(128, activation="relu")(hidden))
        hidden = layers.LayerNormalization()(layers.Add()([hidden, feed_forward]))
        outputs = layers.Dense(2)(layers.GlobalAveragePooling1D()(hidden))
    return model_class(inputs, outputs, name=name)


def compile_default(model: Any) -> Any:
    """Adam, the loss, and otherwise Keras' defaults (`jit_compile="auto"`)."""
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def synthetic_batches(name: str, batch_size: int, num_batches: int = 4) -> tuple[Any, Any]:
    """Random inputs and labels for `num_batches` batches (numpy)."""
    rng = np.random.default_rng(0)
    size = batch_size * num_batches
    if name in ("text", "transformer"):
        return rng.integers(0, 1000, (size, 32), dtype=np.int32), rng.integers(0, 2, size)
    shape = (784,) if name == "mlp" else (28, 28, 1)
    return rng.standard_normal((size, *shape), dtype=np.float32), rng.integers(0, 10, size)


def repeated_dataset(name: str, batch_size: int, static_batch: bool) -> Any:
    """An endless dataset over in-memory tensors: `fit` copies no data per call.

    Unless `static_batch`, the batch dimension is unknown when the steps are traced, as
    with most tf.data pipelines and numpy inputs whose length B does not divide.
    """
    dataset = tf.data.Dataset.from_tensor_slices(synthetic_batches(name, batch_size))
    return dataset.batch(batch_size, drop_remainder=static_batch).repeat().prefetch(2)


def jacobian_gib(model: Any, batch_size: int) -> float:
    """Estimated peak of `tape.jacobian` (pfor): B x params, plus B backward passes run
    side by side, each over the whole batch's activations; float32, ~3 live copies.
    Measured peaks were 0.3 to 0.9 times this."""
    activations = 0
    for layer in model.layers[1:]:
        activations += math.prod(layer.output.shape[1:])
        if isinstance(layer, keras.layers.MultiHeadAttention):  # scores and projections
            length, width = layer.output.shape[1:]
            activations += 2 * layer.num_heads * length * length + 4 * length * width
    return 12 * batch_size * (model.count_params() + batch_size * activations) / 2**30


# -- the baselines users write today --------------------------------------------------


def flat(gradients: list[Any]) -> Any:
    return tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in gradients], axis=0)


def per_example_losses(model: Any, x: Any, y: Any) -> Any:
    logits = model(x, training=True)
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def make_tape_loop_step(model: Any, optimizer: Any) -> Callable[[Any, Any], Any]:
    """A train step plus one `GradientTape` per example (`tf.map_fn`): norms, cosines."""
    variables = model.trainable_variables

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_losses(model, x, y))
        batch_gradient = tape.gradient(loss, variables)
        batch_flat = flat(batch_gradient)

        def norm_and_cosine(example: Any) -> Any:
            x_i, y_i = example
            with tf.GradientTape() as example_tape:
                loss_i = tf.reduce_sum(per_example_losses(model, x_i[None], y_i[None]))
            gradient_i = flat(example_tape.gradient(loss_i, variables))
            norm_i = tf.norm(gradient_i)
            return norm_i, tf.tensordot(gradient_i, batch_flat, 1) / (norm_i * tf.norm(batch_flat))

        signature = (tf.float32, tf.float32)
        norms, cosines = tf.map_fn(norm_and_cosine, (x, y), fn_output_signature=signature)
        optimizer.apply(batch_gradient, variables)
        return norms, cosines

    return step


def make_jacobian_step(model: Any, optimizer: Any) -> Callable[[Any, Any], Any]:
    """A train step from `tape.jacobian` of the per-example losses: norms, cosines."""
    variables = model.trainable_variables

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            losses = per_example_losses(model, x, y)
        jacobians = [tf.convert_to_tensor(j) for j in tape.jacobian(losses, variables)]
        batch_gradient = [tf.reduce_mean(j, axis=0) for j in jacobians]
        rows = tf.shape(losses)[0]
        sq_norms = tf.add_n([tf.reduce_sum(tf.reshape(j * j, [rows, -1]), 1) for j in jacobians])
        products = zip(jacobians, batch_gradient)
        dots = tf.add_n([tf.reduce_sum(tf.reshape(j * g, [rows, -1]), 1) for j, g in products])
        norms = tf.sqrt(sq_norms)
        optimizer.apply(batch_gradient, variables)
        return norms, dots / (norms * tf.norm(flat(batch_gradient)))

    return step


# -- the timing child -----------------------------------------------------------------


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


def call_step_seconds(step: Callable[[Any, Any], Any], x: Any, y: Any, calls: int) -> list[float]:
    """Times of `calls` calls of a compiled step, outputs fetched to numpy."""
    seconds = []
    for _ in range(calls):
        begin = time.perf_counter()
        for output in step(x, y):
            output.numpy()
        seconds.append(time.perf_counter() - begin)
    return seconds


@dataclasses.dataclass
class Variant:
    """One timed column of the table.

    Attributes:
        one_step: Traces, then returns the seconds of one more step.
        measure: Seconds per step over the given number of steps.
        fixed_steps: Steps per round; by default as many as `SECONDS_PER_ROUND` allows.
    """

    one_step: Callable[[], float]
    measure: Callable[[int], float]
    fixed_steps: int | None = None
    steps: int = 0
    rounds: list[float] = dataclasses.field(default_factory=list)
    failure: str | None = None

    def warm_up(self, max_steps: int) -> None:
        within_budget = min(max_steps, int(SECONDS_PER_ROUND / self.one_step()))
        self.steps = self.fixed_steps or max(min(3, max_steps), within_budget)


def cell_failure(error: Exception) -> str:
    traceback.print_exc(file=sys.stderr)
    if isinstance(error, (tf.errors.ResourceExhaustedError, MemoryError)):
        return "out of memory"
    return f"error: {type(error).__name__}"


def time_batch_size(name: str, batch_size: int, spec: dict[str, Any], log_dir: str) -> Any:
    """Times every variant at one batch size, in interleaved rounds; returns a table row."""
    keras.utils.set_random_seed(0)
    plain = compile_default(build_model(name, keras.Model))
    tracked = compile_default(build_model(name, kgt.GradientTrackingModel))
    reference = build_model(name, keras.Model)  # runs the loop and the jacobian
    tracked.set_weights(plain.get_weights())
    reference.set_weights(plain.get_weights())
    optimizer = keras.optimizers.Adam()
    optimizer.build(reference.trainable_variables)
    dataset = repeated_dataset(name, batch_size, spec["static_batch"])
    x, y = next(iter(dataset))
    log_paths = (os.path.join(log_dir, f"{name}_{batch_size}_{i}.h5") for i in range(10**9))

    def fit_variant(model: Any, every_n_steps: int = 0, fixed_steps: int | None = None) -> Any:
        def seconds(steps: int) -> list[float]:
            loggers = []
            if every_n_steps:
                path = next(log_paths)
                loggers.append(kgt.HDF5GradientLogger(path, every_n_steps=every_n_steps))
            return fit_step_seconds(model, dataset, steps, loggers)

        # With one tracked step in ten, that step is the cost: a mean, not a median.
        aggregate = statistics.fmean if every_n_steps > 1 else statistics.median
        return Variant(lambda: seconds(1)[0], lambda n: aggregate(seconds(n)), fixed_steps)

    def call_variant(step: Callable[[Any, Any], Any]) -> Variant:
        def one_step() -> float:
            call_step_seconds(step, x, y, 1)  # traces
            return call_step_seconds(step, x, y, 1)[0]

        return Variant(one_step, lambda n: statistics.median(call_step_seconds(step, x, y, n)))

    steps = spec["steps"]
    variants = {
        "plain": fit_variant(plain),
        "tracked": fit_variant(tracked, every_n_steps=1),
        # Whole windows of ten after the dropped steps: exactly steps / 10 tracked steps.
        "tracked_every_10": fit_variant(tracked, 10, fixed_steps=10 * math.ceil(steps / 10)),
        "tape_loop": call_variant(make_tape_loop_step(reference, optimizer)),
        "jacobian": call_variant(make_jacobian_step(reference, optimizer)),
    }
    needed_gib = jacobian_gib(plain, batch_size)
    if needed_gib > JACOBIAN_BUDGET_GIB:
        variants["jacobian"].failure = f"skipped (needs ~{needed_gib:.0f} GiB)"
    for round_index in range(-1, spec["rounds"]):  # round -1 traces and sets the steps
        for variant_name, variant in variants.items():
            if variant.failure:
                continue
            if variant_name in SLOW_BASELINES and round_index >= BASELINE_ROUNDS:
                continue
            emit({"stage": [batch_size, variant_name, round_index]})
            try:
                if round_index < 0:
                    variant.warm_up(steps)
                else:
                    variant.rounds.append(variant.measure(variant.steps))
            except Exception as error:
                variant.failure = cell_failure(error)
        gc.collect()
    row: dict[str, Any] = {"batch_size": batch_size, "ratios": {}}
    plain_rounds = variants["plain"].rounds
    for variant_name, variant in variants.items():
        row[variant_name] = variant.failure or statistics.median(variant.rounds) * 1e3
        if not variant.failure and plain_rounds and variant.rounds:
            # Paired: each round's time over plain's in the same round, then the median.
            paired = [t / p for t, p in zip(variant.rounds, plain_rounds)]
            row["ratios"][variant_name] = statistics.median(paired)
    row["steps"] = "/".join(str(variant.steps or "-") for variant in variants.values())
    return row


def run_timing_child(spec: dict[str, Any]) -> None:
    name = spec["model"]
    tracked = compile_default(build_model(name, kgt.GradientTrackingModel))
    plain = compile_default(build_model(name, keras.Model))
    x, y = synthetic_batches(name, 32, num_batches=1)
    tracked.gradient_statistics(x, y)  # traces one tracked step: the summary shows each form
    emit(
        {
            "summary": tracked.gradient_tracking_summary(print_fn=lambda _: None),
            "params": tracked.count_params(),
            "jit_compile": f"plain={plain.jit_compile}, tracked={tracked.jit_compile}",
        }
    )
    with tempfile.TemporaryDirectory(prefix="overhead-") as log_dir:
        for batch_size in spec["batch_sizes"]:
            emit({"row": time_batch_size(name, batch_size, spec, log_dir)})


# -- the memory child -----------------------------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_memory_child(spec: dict[str, Any]) -> None:
    """RSS after build, peaks of one warm-up step and of a `fit`, in a fresh process."""
    name, batch_size, tracked = spec["model"], spec["batch_size"], spec["variant"] == "tracked"
    model = compile_default(
        build_model(name, kgt.GradientTrackingModel if tracked else keras.Model)
    )
    dataset = repeated_dataset(name, batch_size, spec["static_batch"])
    with tempfile.TemporaryDirectory(prefix="overhead-") as log_dir:

        def fit(steps: int, log_name: str) -> float:
            callbacks = [kgt.HDF5GradientLogger(os.path.join(log_dir, log_name))] if tracked else []
            model.fit(dataset, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
            gc.collect()
            return peak_rss_mib()

        built = rss_mib()
        warm_up_peak = fit(1, "warm_up.h5")
        after_warm_up = rss_mib()
        # Writing 5 resets the kernel's peak-RSS mark (ru_maxrss) to the current RSS, so
        # the next peak is the fit's own, not the tracing's of the warm-up step.
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        fit_peak = fit(spec["steps"], "fit.h5")
    growth = fit_peak - after_warm_up
    emit({"memory": [built, warm_up_peak, after_warm_up, fit_peak, growth]})


def emit(message: dict[str, Any]) -> None:
    print(MESSAGE_PREFIX + json.dumps(message), flush=True)


def child_main(spec: dict[str, Any]) -> None:
    limit = int(spec["memory_limit_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:
        (run_memory_child if spec["kind"] == "memory" else run_timing_child)(spec)
    except Exception as error:
        emit({"failure": cell_failure(error)})
        raise


# -- the parent -----------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_child(spec: dict[str, Any], on_message: Callable[[dict[str, Any]], None]) -> int:
    """Runs this script as a child on `spec`, passing on its messages; its exit code."""
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(MESSAGE_PREFIX):
                on_message(json.loads(line[len(MESSAGE_PREFIX) :]))
        code = process.wait()
        if code != 0:
            stderr.seek(0)
            progress(f"child {spec} exited {code}; its stderr ends:\n{stderr.read()[-3000:]}")
    return code


def time_model(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """The model's header (plan, parameters) and one table row per batch size."""
    header: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    stage: list[Any] = []

    def on_message(message: dict[str, Any]) -> None:
        if "stage" in message:
            stage[:] = message["stage"]
            when = "warm-up" if stage[2] < 0 else f"round {stage[2] + 1}"
            progress(f"{name} B={stage[0]} {stage[1]} {when}")
        elif "row" in message:
            rows.append(message["row"])
        else:
            header.update(message)

    spec = {**vars(args), "kind": "timing", "model": name}
    code = run_child(spec, on_message)
    if code != 0:  # a hard crash (a caught error only fails its cell)
        where = f" in {stage[1]} at B={stage[0]}" if stage else ""
        done = {row["batch_size"] for row in rows}
        failure = f"child exited {code}{where}"
        rows += [{"batch_size": b, "failure": failure} for b in args.batch_sizes if b not in done]
    return header, rows


def measure_memory(args: argparse.Namespace) -> dict[tuple[str, int, str], Any]:
    """Memory figures (MiB) per (model, batch size, variant), two fresh children at a time."""

    def one(key: tuple[str, int, str]) -> Any:
        name, batch_size, variant = key
        spec = {**vars(args), "kind": "memory", "model": name, "steps": min(args.steps, 5)}
        result: dict[str, Any] = {}
        code = run_child({**spec, "batch_size": batch_size, "variant": variant}, result.update)
        progress(f"memory {name} B={batch_size} {variant} done")
        return result.get("memory") or result.get("failure") or f"child exited {code}"

    keys = [(m, b, v) for m in args.models for b in args.batch_sizes for v in ("plain", "tracked")]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(keys, pool.map(one, keys)))


def machine_description() -> list[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), "?")
    with open("/proc/meminfo") as meminfo:
        memory_gib = int(meminfo.readline().split()[1]) / 2**20
    versions = ", ".join(
        f"{package} {importlib.metadata.version(package)}"
        for package in ("tensorflow", "keras", "keras-gradtrack", "numpy", "h5py")
    )
    here = os.path.dirname(os.path.abspath(__file__))
    git = ["git", "-C", here, "describe", "--always", "--dirty"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown"
    return [
        f"- CPU: {cpu}, {len(os.sched_getaffinity(0))} cores usable "
        f"({os.cpu_count()} logical), {memory_gib:.0f} GiB RAM, no GPU",
        f"- Python {platform.python_version()}, {versions}",
        f"- commit {commit}; load average at start {os.getloadavg()[0]:.1f}",
    ]


def number(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ratio(value: Any, reference: Any, paired: float | None = None) -> str:
    if paired is not None:
        return number(paired) + "x"
    if not all(isinstance(v, (int, float)) for v in (value, reference)) or reference <= 0:
        return "-"
    return number(value / reference) + "x"


TABLE_HEADER = (
    "| model | B | plain ms/step | tracked ms/step | tracked / plain | every-10 ms/step "
    "| every-10 / plain | tape loop ms/step | loop / plain | jacobian ms/step "
    "| jacobian / plain | plain peak MiB | tracked peak MiB | peak ratio | steps/round |"
)
MEMORY_HEADER = (
    "| model | B | variant | RSS after build | peak, warm-up step | RSS after warm-up "
    "| peak, fit | growth |"
)


def table_row(name: str, row: dict[str, Any], memory: dict[Any, Any]) -> str:
    if "failure" in row:
        return f"| {name} | {row['batch_size']} | {row['failure']} |" + " |" * 12
    cells = [name, str(row["batch_size"]), number(row["plain"])]
    for variant in VARIANTS[1:]:
        paired = row.get("ratios", {}).get(variant)
        cells += [number(row[variant]), ratio(row[variant], row["plain"], paired)]
    growth = []
    for variant in ("plain", "tracked"):
        measured = memory.get((name, row["batch_size"], variant), "-")
        growth.append(measured[-1] if isinstance(measured, list) else measured)
    cells += [number(growth[0]), number(growth[1]), ratio(growth[1], growth[0]), row["steps"]]
    return "| " + " | ".join(cells) + " |"


def memory_row(key: tuple[str, int, str], measured: Any) -> str:
    figures = measured if isinstance(measured, list) else [measured] + [""] * 4
    return "| " + " | ".join([key[0], str(key[1]), key[2], *map(number, figures)]) + " |"


def separator(header: str) -> str:
    return "|" + " --- |" * (header.count("|") - 1)


def report(args: argparse.Namespace, results: dict[str, Any], memory: dict[Any, Any]) -> str:
    lines = ["# keras_gradtrack overhead benchmark", "", *machine_description(), ""]
    lines.append(
        f"{args.rounds} interleaved rounds; per round up to {args.steps} fit steps per "
        f"variant (after {WARMUP_STEPS} dropped), fewer for steps slower than "
        f"{SECONDS_PER_ROUND:.0f} s per round (the loop and jacobian: the first "
        f"{BASELINE_ROUNDS} rounds only); the median step per round (every-10: the mean), "
        "then the median over rounds. Ratios: the median over rounds of each round's time "
        "over plain's in the same round (paired, so load drift between rounds cancels). Peak MiB: growth of peak RSS during fit over the RSS "
        "after build and one warm-up step, each in a fresh process. The fit steps are traced "
        + ("with a static batch size." if args.static_batch else "with an unknown batch size.")
    )
    for name, (header, _) in results.items():
        lines += [
            "",
            f"## {name}: {header.get('params', '?')} parameters, jit_compile "
            f"{header.get('jit_compile', '?')}",
            "",
            "```",
            header.get("summary", "(no plan: the child failed)"),
            "```",
        ]
    lines += ["", "## Results", "", TABLE_HEADER, separator(TABLE_HEADER)]
    for name, (_, rows) in results.items():
        lines += [table_row(name, row, memory) for row in rows]
    if memory:
        lines += ["", "Memory (MiB):", "", MEMORY_HEADER, separator(MEMORY_HEADER)]
        lines += [memory_row(key, measured) for key, measured in memory.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def model_names(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in MODELS]
        if unknown:
            raise argparse.ArgumentTypeError(f"Expected models in {MODELS}. Received: {unknown}")
        return names

    def batch_sizes(text: str) -> list[int]:
        return [int(size) for size in text.split(",") if size]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=model_names, default=list(MODELS), help="comma-separated")
    parser.add_argument("--batch-sizes", type=batch_sizes, help="default 32,128,512")
    parser.add_argument("--steps", type=int, help="timed fit steps per variant per round (30)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (7)")
    parser.add_argument(
        "--static-batch",
        action="store_true",
        help="batch size known at trace time (default: unknown, as with most tf.data input)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory columns")
    parser.add_argument("--quick", action="store_true", help="smoke test: B=32, 10 steps, 1 round")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument(
        "--memory-limit-gib", type=float, default=8.0, help="cap per child process (8)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_sizes = args.batch_sizes or ([32] if args.quick else list(BATCH_SIZES))
    args.steps = args.steps or (10 if args.quick else 30)
    args.rounds = args.rounds or (1 if args.quick else 7)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    started = time.perf_counter()
    results = {}
    for name in args.models:
        progress(f"timing {name}")
        results[name] = time_model(name, args)
    memory = {} if args.no_memory else measure_memory(args)
    text = report(args, results, memory)
    text += f"\n\nTotal time: {(time.perf_counter() - started) / 60:.1f} min.\n"
    print(text, end="")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()

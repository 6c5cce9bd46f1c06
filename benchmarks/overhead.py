"""What exact per-example gradient statistics cost in Keras `fit`, across a zoo of models.

For each model of `zoo.py`: the time per training step of plain `keras.Model.fit` and of
`GradientTrackingModel.fit` with `HDF5GradientLogger` (every step, and every 10th step),
as wall-clock and as process CPU time; the fixed cost of one `fit` and what a fit of 8
steps costs; and the peak-memory growth of plain and tracked `fit`, each in a fresh
process. Prints the machine, each model's tracking plan and a markdown table (columns:
benchmarks/README.md). One command makes the whole table:

```
python benchmarks/overhead.py --out benchmarks/results/overhead.md   # the zoo, ~35 min
python benchmarks/overhead.py --quick                                # smoke test
python benchmarks/overhead.py --models cnn,mobilenet --device gpu    # on a GPU
python benchmarks/overhead.py --models mlp,cnn --baselines           # + tape loop, jacobian
python benchmarks/overhead.py --no-timing --memory-repeats 3         # memory alone, medians
```
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import report
import tensorflow as tf
from baselines import JACOBIAN_BUDGET_GIB, jacobian_gib, make_jacobian_step, make_tape_loop_step
from zoo import ZOO, build_compiled, synthetic_batches

import keras_gradtrack as kgt

WARMUP_STEPS = 2  # dropped at the start of every timed `fit` (iterator start-up)
SHORT_FIT_STEPS = 8  # a short epoch: what a `fit` of this many steps costs
SECONDS_PER_ROUND = 4.0  # a slow variant times fewer steps per round
MIN_STEPS = SHORT_FIT_STEPS - WARMUP_STEPS
BASELINE_ROUNDS = 3  # the loop and jacobian are timed in the first rounds only
MESSAGE_PREFIX = "@@overhead "  # marks the child's JSON lines among library output


def emit(message: dict[str, Any]) -> None:
    print(MESSAGE_PREFIX + json.dumps(message), flush=True)


# -- the timing child ------------------------------------------------------------------


def timing_child(spec: dict[str, Any]) -> None:
    """Times every variant of one model in interleaved rounds; emits the plan and a row."""
    name, batch_size = spec["model"], spec["batch_size"]
    keras.utils.set_random_seed(0)
    plain = build_compiled(name, keras.Model)
    tracked = build_compiled(name, kgt.GradientTrackingModel)
    tracked.set_weights(plain.get_weights())
    data = synthetic_batches(name, batch_size)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat().prefetch(2)
    log_dir = tempfile.mkdtemp(prefix="overhead-")
    log_paths = (os.path.join(log_dir, f"{i}.h5") for i in range(10**9))

    class StepStart(keras.callbacks.Callback):
        """First in the callback list: notes when each step begins (wall and CPU)."""

        marks = (0.0, 0.0)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.marks = (time.perf_counter(), time.process_time())

    class StepEnd(keras.callbacks.Callback):
        """Last in the callback list (after the logger): wall and CPU time of each step."""

        def __init__(self, start: StepStart) -> None:
            super().__init__()
            self.start, self.steps = start, []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            wall, cpu = self.start.marks
            self.steps.append((time.perf_counter() - wall, time.process_time() - cpu))

    def fit_variant(model: Any, every_n_steps: int = 0) -> Callable[[int], dict[str, Any]]:
        def run(steps: int) -> dict[str, Any]:
            start = StepStart()
            end = StepEnd(start)
            callbacks: list[Any] = [start, end]
            if every_n_steps:
                logger = kgt.HDF5GradientLogger(next(log_paths), every_n_steps=every_n_steps)
                callbacks.insert(1, logger)
            begin = time.perf_counter()
            model.fit(dataset, steps_per_epoch=WARMUP_STEPS + steps, verbose=0, callbacks=callbacks)
            fit_wall = time.perf_counter() - begin
            walls = [wall for wall, _ in end.steps]
            # With one tracked step in ten, that step is the cost: a mean, not a median.
            middle = statistics.fmean if every_n_steps > 1 else statistics.median
            timed = end.steps[WARMUP_STEPS:]
            return {
                "wall": middle([wall for wall, _ in timed]),
                "cpu": middle([cpu for _, cpu in timed]),
                "fixed": fit_wall - sum(walls),
                "short_fit": fit_wall - sum(walls[SHORT_FIT_STEPS:]),
            }

        return run

    def call_variant(step: Any) -> Callable[[int], dict[str, Any]]:
        x, y = next(iter(dataset))

        def run(steps: int) -> dict[str, Any]:
            times = []
            for _ in range(steps + 1):  # the first call traces or warms up
                wall, cpu = time.perf_counter(), time.process_time()
                for output in step(x, y):
                    output.numpy()
                times.append((time.perf_counter() - wall, time.process_time() - cpu))
            return {
                "wall": statistics.median(t for t, _ in times[1:]),
                "cpu": statistics.median(c for _, c in times[1:]),
            }

        return run

    variants = {
        "plain": fit_variant(plain),
        "tracked": fit_variant(tracked, every_n_steps=1),
        "every_10": fit_variant(tracked, every_n_steps=10),
    }
    failures: dict[str, str] = {}
    if spec["baselines"]:
        reference = build_compiled(name, keras.Model)
        reference.set_weights(plain.get_weights())
        optimizer = keras.optimizers.Adam()
        optimizer.build(reference.trainable_variables)
        loss = ZOO[name].data.loss()
        variants["tape_loop"] = call_variant(make_tape_loop_step(reference, loss, optimizer))
        variants["jacobian"] = call_variant(make_jacobian_step(reference, loss, optimizer))
        needed = jacobian_gib(plain, batch_size)
        if needed > JACOBIAN_BUDGET_GIB:
            failures["jacobian"] = f"skipped (needs ~{needed:.0f} GiB)"

    steps: dict[str, int] = {}
    for variant, run in variants.items():  # traces, and sets the steps per round
        emit({"stage": [variant, "warm-up"]})
        try:
            seconds = run(1)["wall"] if variant != "every_10" else run(10)["wall"] * 10
            fitting = max(1, int(SECONDS_PER_ROUND / max(seconds, 1e-6)))
            if variant == "every_10":
                steps[variant] = 10 * max(1, min(spec["steps"], fitting) // 10)
            else:
                floor = 1 if variant in ("tape_loop", "jacobian") else MIN_STEPS
                steps[variant] = max(floor, min(spec["steps"], fitting))
        except Exception as error:
            failures[variant] = report.failure_text(error)
    emit(
        {
            "summary": tracked.gradient_tracking_summary(print_fn=lambda _: None),
            "params": plain.count_params(),
            "jit_compile": f"plain {plain.jit_compile}, tracked {tracked.jit_compile}",
            "devices": report.device_description(),
        }
    )

    rounds: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    order = list(variants)
    for round_index in range(spec["rounds"]):
        # Each round starts with another variant, so none always follows the same one.
        shift = round_index % len(order)
        for variant in order[shift:] + order[:shift]:
            if variant in failures:
                continue
            if variant in ("tape_loop", "jacobian") and round_index >= BASELINE_ROUNDS:
                continue
            emit({"stage": [variant, f"round {round_index + 1}"]})
            try:
                rounds[variant].append({"round": round_index, **variants[variant](steps[variant])})
            except Exception as error:
                failures[variant] = report.failure_text(error)
    emit({"row": report.timing_row(rounds, failures, steps)})


# -- the memory child ------------------------------------------------------------------


def memory_child(spec: dict[str, Any]) -> None:
    """Peak memory growth of one `fit` over the memory in use just before it.

    On CPU: peak RSS (the kernel's mark, reset before `fit`) minus RSS before it.
    On GPU: the allocator's own peak minus what it held before.
    """
    name, batch_size = spec["model"], spec["batch_size"]
    tracked = spec["variant"] == "tracked"
    model = build_compiled(name, kgt.GradientTrackingModel if tracked else keras.Model)
    data = synthetic_batches(name, batch_size, num_batches=2)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat().prefetch(2)
    log_path = os.path.join(tempfile.mkdtemp(prefix="overhead-"), "run.h5")
    callbacks = [kgt.HDF5GradientLogger(log_path)] if tracked else []
    gpu = spec["device"] == "gpu"
    if gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
        before = tf.config.experimental.get_memory_info("GPU:0")["current"] / 2**20
    else:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        before = int(line.split()[1]) / 1024
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets the peak-RSS mark (ru_maxrss) to the current RSS
    model.fit(dataset, steps_per_epoch=spec["memory_steps"], verbose=0, callbacks=callbacks)
    if gpu:
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    emit({"memory": {"before": before, "peak": peak, "growth": peak - before}})


def child_main(spec: dict[str, Any]) -> None:
    limit = int(spec["memory_limit_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    if spec["device"] == "gpu" and not tf.config.list_physical_devices("GPU"):
        raise SystemExit("--device gpu: TensorFlow sees no GPU on this machine.")
    try:
        (memory_child if spec["kind"] == "memory" else timing_child)(spec)
    except Exception as error:
        emit({"failure": report.failure_text(error)})
        raise


# -- the parent ------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_child(spec: dict[str, Any], on_message: Callable[[dict[str, Any]], None]) -> int:
    """Runs this script as a child on `spec`, passing on its messages; its exit code."""
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if spec["device"] == "cpu":
        environment["CUDA_VISIBLE_DEVICES"] = "-1"  # set before TensorFlow starts
    if spec["onednn"] != "default":
        environment["TF_ENABLE_ONEDNN_OPTS"] = "1" if spec["onednn"] == "on" else "0"
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=environment
        )
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(MESSAGE_PREFIX):
                on_message(json.loads(line[len(MESSAGE_PREFIX) :]))
        code = process.wait()
        if code != 0:
            stderr.seek(0)
            progress(
                f"child {spec['kind']} {spec['model']} exited {code}:\n{stderr.read()[-3000:]}"
            )
    return code


def time_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The model's plan and its timing row (or why there is none)."""
    result: dict[str, Any] = {}

    def on_message(message: dict[str, Any]) -> None:
        if "stage" in message:
            progress(f"{name}: {' '.join(message['stage'])}")
        result.update(message)

    spec = {**vars(args), "kind": "timing", "model": name}
    code = run_child(spec, on_message)
    if "row" not in result:
        result["failure"] = result.get("failure") or f"child exited {code}"
    return result


def measure_memory(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """Memory growth per (model, variant), each run in a fresh child, two children at a
    time; with `--memory-repeats N`, N runs each (plain and tracked side by side in each
    repeat), reported as their median with every run kept under "runs"."""

    def one(key: tuple[str, str, int]) -> Any:
        name, variant, _ = key
        spec = {**vars(args), "kind": "memory", "model": name, "variant": variant}
        spec["batch_size"] = args.memory_batch_size
        result: dict[str, Any] = {}
        code = run_child(spec, result.update)
        progress(f"memory {name} {variant} done")
        return result.get("memory") or result.get("failure") or f"child exited {code}"

    keys = [
        (name, variant, repeat)
        for repeat in range(args.memory_repeats)
        for name in args.models
        for variant in ("plain", "tracked")
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        measured = dict(zip(keys, pool.map(one, keys)))
    memory: dict[tuple[str, str], Any] = {}
    for name in args.models:
        for variant in ("plain", "tracked"):
            runs = [measured[(name, variant, r)] for r in range(args.memory_repeats)]
            failures = [run for run in runs if not isinstance(run, dict)]
            if failures:
                memory[(name, variant)] = failures[0]
                continue
            growth = [run["growth"] for run in runs]
            memory[(name, variant)] = {"growth": statistics.median(growth), "runs": growth}
    return memory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def model_names(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in ZOO]
        if unknown:
            raise argparse.ArgumentTypeError(f"Expected models in {list(ZOO)}. Received: {unknown}")
        return names

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", type=model_names, default=list(ZOO), help="comma-separated (all of zoo.py)")
    add("--batch-size", type=int, default=128, help="batch size of the timing (128)")
    add("--memory-batch-size", type=int, default=512, help="batch size of the memory (512)")
    add("--steps", type=int, help="timed fit steps per variant per round (10)")
    add("--rounds", type=int, help="interleaved rounds (7)")
    add("--memory-steps", type=int, default=5, help="steps of the measured fit (5)")
    add("--device", choices=("cpu", "gpu"), default="cpu", help="where the steps run (cpu)")
    add("--onednn", choices=("default", "on", "off"), default="default", help="CPU oneDNN")
    add("--baselines", action="store_true", help="also time the tape loop and tape.jacobian")
    add("--no-memory", action="store_true", help="skip the memory columns")
    add("--no-timing", action="store_true", help="only the memory columns")
    add("--memory-repeats", type=int, default=1, help="runs per memory figure, median (1)")
    add("--quick", action="store_true", help="smoke test: mlp and cnn, B=32, 1 round")
    add("--out", help="also write the report (markdown) to this file")
    add("--memory-limit-gib", type=float, default=8.0, help="cap per child process (8)")
    add("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.models = [name for name in args.models if name in ("mlp", "cnn")] or args.models
        args.batch_size, args.memory_batch_size, args.memory_steps = 32, 64, 2
    args.steps = args.steps or (MIN_STEPS if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 7)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    timings = {}
    for name in [] if args.no_timing else args.models:
        progress(f"timing {name}")
        timings[name] = time_model(name, args)
    memory = {} if args.no_memory else measure_memory(args)
    minutes = (time.perf_counter() - started) / 60
    load_after = os.getloadavg()[0]
    if args.no_timing:
        text = report.render_memory(args, memory, load_before, load_after, minutes)
    else:
        text = report.render(args, timings, memory, load_before, load_after, minutes)
    report.print_and_save(text, args.out)


if __name__ == "__main__":
    main()

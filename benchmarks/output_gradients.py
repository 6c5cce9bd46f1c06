"""Per-output-feature weight gradients: time and memory of five ways to get them.

The case from issue 4: Conv1D(512) -> Conv1D(512) -> Dense(144) on inputs of shape
(16, 64, 16); for each of the 144 output features f, `d sum(y[..., f]) / d W` for
every kernel and bias. Each method runs in a fresh subprocess, which builds the
model, runs one forward pass, reads its RSS (the baseline), computes every
feature's gradient (reducing it to norms and dropping it, unless the method keeps
them) and reports its peak RSS (`ru_maxrss`) minus the baseline.

    python benchmarks/output_gradients.py            # the issue's case
    python benchmarks/output_gradients.py --small    # a quick run
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # Before TensorFlow is imported.

METHODS = {
    "output_gradients": "keras_gradtrack `output_gradients`, chunk_size={chunk_size}",
    "vectorized": "one forward + `tf.vectorized_map` over the chunk's VJPs, chunk {chunk_size}",
    "tape_loop": "persistent tape, {num_features} `tape.gradient` calls, each dropped",
    "tape_loop_keep": "persistent tape, {num_features} `tape.gradient` calls, all kept",
    "tape_jacobian": "`tape.jacobian` of the whole output",
}
REFERENCE = "tape_loop"
BYTES_PER_FLOAT = 4
# float32 sums taken in another order (e.g. vectorized convolutions) differ by ~1e-5.
FLOAT32_AGREEMENT = 1e-4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--input-features", type=int, default=16)
    parser.add_argument("--filters", type=int, default=512)
    parser.add_argument("--num-features", type=int, default=144)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs per method; min time")
    parser.add_argument("--max-jacobian-gib", type=float, default=12.0)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--small", action="store_true", help="a small model, for a quick run")
    parser.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--compare-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.small:
        args.batch_size, args.sequence_length, args.filters, args.num_features = 4, 16, 32, 12
        args.chunk_size = 5
    return args


def build_model(args):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((args.sequence_length, args.input_features)),
            keras.layers.Conv1D(args.filters, 3, padding="same", activation="relu"),
            keras.layers.Conv1D(args.filters, 3, padding="same", activation="relu"),
            keras.layers.Dense(args.num_features),
        ]
    )
    x = np.random.default_rng(0).normal(
        size=(args.batch_size, args.sequence_length, args.input_features)
    )
    return model, x.astype("float32")


def compared_features(num_features):
    return sorted({0, num_features // 2, num_features - 1})


def current_rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_child(args):
    """Runs one method; prints a JSON line with its time, memory and per-feature norms."""
    import tensorflow as tf

    from keras_gradtrack import autodiff

    model, x = build_model(args)
    variables = model.trainable_variables
    model(x)  # Warm up the runtime so that the baseline includes it.
    baseline_mib = current_rss_mib()
    norms = np.zeros((args.num_features, len(variables)))
    kept = []
    first_result_seconds = []

    def consume(feature_indices, grads):
        if not first_result_seconds:
            first_result_seconds.append(time.perf_counter() - start_wall)
        for k, feature in enumerate(feature_indices):
            per_variable = [np.asarray(g[k]) for g in grads]
            norms[feature] = [np.linalg.norm(g) for g in per_variable]
            if feature in compared_features(args.num_features):
                np.savez(Path(args.compare_dir) / f"{args.child}_{feature}.npz", *per_variable)

    start_wall, start_cpu = time.perf_counter(), time.process_time()
    if args.child == "output_gradients":
        for feature_indices, grads in autodiff.output_gradients(
            model, x, chunk_size=args.chunk_size
        ):
            consume(feature_indices, grads)
    elif args.child == "vectorized":
        chunk = vectorized_chunk_function(tf, model, variables, args.num_features)
        for start in range(0, args.num_features, args.chunk_size):
            feature_indices = np.arange(start, min(start + args.chunk_size, args.num_features))
            padded = np.arange(start, start + args.chunk_size, dtype="int32")
            consume(feature_indices, chunk(x, padded))
    elif args.child in ("tape_loop", "tape_loop_keep"):
        with tf.GradientTape(persistent=True) as tape:
            y = model(x)
            per_feature_sums = [tf.reduce_sum(y[..., f]) for f in range(args.num_features)]
        for feature, feature_sum in enumerate(per_feature_sums):
            grads = tape.gradient(feature_sum, variables)
            if args.child == "tape_loop_keep":
                kept.append(grads)
            consume([feature], [g[None] for g in grads])
    elif args.child == "tape_jacobian":
        with tf.GradientTape() as tape:
            y = model(x)
        jacobians = tape.jacobian(y, variables)  # (batch, length, features, *variable)
        consume(range(args.num_features), [tf.reduce_sum(j, axis=(0, 1)) for j in jacobians])
    seconds = time.perf_counter() - start_wall
    cpu_seconds = time.process_time() - start_cpu
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    forward = tf.function(model)
    forward(x)
    forward_start = time.perf_counter()
    for _ in range(10):
        forward(x)
    forward_seconds = (time.perf_counter() - forward_start) / 10
    result = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "growth_mib": peak_mib - baseline_mib,
        "first_result_seconds": first_result_seconds[0],
        "forward_seconds": forward_seconds,
        "norms": norms.tolist(),
        "num_params": int(sum(np.prod(v.shape) for v in variables)),
    }
    print(json.dumps(result))


def vectorized_chunk_function(tf, model, variables, num_features):
    """The design issue 4 proposed: vectorized VJPs over one-hot cotangents."""

    @tf.function(autograph=False)
    def chunk(x, feature_indices):
        with tf.GradientTape() as tape:
            y = model(x)

        def vjp(feature):
            one_hot = tf.one_hot(feature, num_features, dtype=y.dtype)
            return tape.gradient(y, variables, output_gradients=tf.broadcast_to(one_hot, y.shape))

        return tf.vectorized_map(vjp, feature_indices)

    return chunk


def run_in_subprocess(method, args, compare_dir):
    command = [sys.executable, __file__, "--child", method, "--compare-dir", compare_dir]
    for name in ("batch_size", "sequence_length", "input_features", "filters"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--num-features", str(args.num_features), "--chunk-size", str(args.chunk_size)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def max_relative_error(method, compare_dir, num_features):
    """max |g - g_ref| / max |g_ref| over the compared features and every variable."""
    errors = []
    for feature in compared_features(num_features):
        with (
            np.load(Path(compare_dir) / f"{method}_{feature}.npz") as grads,
            np.load(Path(compare_dir) / f"{REFERENCE}_{feature}.npz") as reference,
        ):
            for name in reference.files:
                scale = np.abs(reference[name]).max()
                errors.append(np.abs(grads[name] - reference[name]).max() / scale)
    return max(errors)


def describe_machine():
    import keras
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        names = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
    cpu = names[0] if names else cpu
    return (
        f"{os.cpu_count()}-core CPU ({cpu}), no GPU; TensorFlow {tf.__version__}, "
        f"Keras {keras.__version__}, Python {platform.python_version()}"
    )


def main():
    args = parse_args()
    if args.child:
        run_child(args)
        return
    model, x = build_model(args)
    num_params = model.count_params()
    output_elements = x.shape[0] * x.shape[1] * args.num_features
    per_feature_gib = args.num_features * num_params * BYTES_PER_FLOAT / 2**30
    whole_jacobian_gib = output_elements * num_params * BYTES_PER_FLOAT / 2**30
    print(describe_machine())
    print(
        f"model: {num_params:,} parameters; output {tuple(model(x).shape)}; "
        f"per-feature Jacobian ({args.num_features} x params x 4 B): "
        f"{per_feature_gib * 1024:,.1f} MiB (half: {per_feature_gib * 512:,.1f} MiB); "
        f"whole-output Jacobian ({output_elements:,} x params x 4 B): {whole_jacobian_gib:,.1f} GiB"
    )
    labels = {method: label.format(**vars(args)) for method, label in METHODS.items()}
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as compare_dir:
        for method in [REFERENCE] + [m for m in args.methods if m != REFERENCE]:
            if method == "tape_jacobian" and whole_jacobian_gib > args.max_jacobian_gib:
                skipped = f"skipped: would need {whole_jacobian_gib:,.0f} GiB"
                rows.append((labels[method], "-", "-", "-", skipped))
                continue
            runs = [run_in_subprocess(method, args, compare_dir) for _ in range(args.repeats)]
            results[method] = runs
            error = max_relative_error(method, compare_dir, args.num_features)
            if method == REFERENCE:
                exact = "reference"
            else:
                exact = f"{'yes' if error < FLOAT32_AGREEMENT else 'NO'}, {error:.1e}"
            rows.append(
                (
                    labels[method],
                    f"{min(r['seconds'] for r in runs):.2f}",
                    f"{min(r['cpu_seconds'] for r in runs):.2f}",
                    f"{max(r['growth_mib'] for r in runs):,.0f}",
                    exact,
                )
            )
    print()
    print("| method | wall time (s) | CPU time (s) | RSS growth (MiB) | exact? (max rel. error) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if "output_gradients" in results:
        run = min(results["output_gradients"], key=lambda r: r["seconds"])
        num_chunks = -(-args.num_features // args.chunk_size)
        chunk_seconds = (run["seconds"] - run["first_result_seconds"]) / max(num_chunks - 1, 1)
        print(
            f"\noutput_gradients: first chunk {run['first_result_seconds']:.2f} s (tracing "
            f"included), then {chunk_seconds * 1e3:.0f} ms per chunk of {args.chunk_size}; "
            f"a compiled forward pass takes {run['forward_seconds'] * 1e3:.1f} ms, so "
            f"recomputing it per chunk costs {run['forward_seconds'] / chunk_seconds:.0%}."
        )
    print(f"{args.repeats} run(s) per method, each in a fresh process; min time, max growth.")


if __name__ == "__main__":
    main()

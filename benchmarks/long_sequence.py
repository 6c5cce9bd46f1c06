"""Peak memory and step time of a tracked step on keras_hub causal LMs at long sequences.

Every Dense and EinsumDense layer of a causal LM sees T positions per example: its
per-example squared norm costs `T^2 (in + out)` by the Gram form, or `in * out` values
per example materialized. For each model, sequence length T, backend and variant
(plain `fit`, tracked `fit` with the default statistics, tracked with the norms only),
a fresh process builds the model from a config (random weights, nothing downloaded;
token ids and a padding mask fed directly, no preprocessor) and runs three `fit`s: one
step (tracing the step), one step more (TensorFlow traces the tracked step again at
its second `fit`), then `--steps` steps. Memory is the peak growth during a `fit` over
the memory in use just before it (CPU: peak RSS, the kernel's mark reset before the
`fit`, buffers of 256 KiB and more handed back to the system when freed; GPU: the
allocator's peak): "MiB" of the first `fit` (tracing, compiling and one step), "later
steps MiB" of the last (TensorFlow's kernels keep their buffers from step to step, so
there it shows little). On JAX also XLA's buffer assignment of the compiled train
step (arguments, outputs not donated into them, temporaries): the most the step holds
at once, independent of the allocator and of what compiling took on the host. Time:
the median step of the last `fit`, each step waited for by reading the optimizer's step
counter back to the host. The table gives the ratios to the plain step and how many
tracked layers took each form: TensorFlow's `direct` (for Dense and EinsumDense on
sequences: the Gram form), `materialized`, `jacobian` (the per-layer fallback); on JAX
the plan's path. With `--lora RANK` every variant's backbone has LoRA enabled (the
plain step is then the plain LoRA step); the `private` variant is `make_private`
(clip 1, noise multiplier 1) without statistics.

```
python benchmarks/long_sequence.py                                  # T 128, 512, 1024
python benchmarks/long_sequence.py --variants tracked,norms         # + the norms only
python benchmarks/long_sequence.py --seq-lens 2048,4096 --backends jax
python benchmarks/long_sequence.py --lora 4 --variants tracked,private   # LoRA fine-tuning
python benchmarks/long_sequence.py --backends jax --warm-compile    # first fit, not compiling
python benchmarks/long_sequence.py --models gpt2 --seq-lens 128 --steps 2   # smoke test
```
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jax_overhead import BlockReader

MESSAGE_PREFIX = "@@long_sequence "
VARIANTS = ("plain", "tracked", "norms", "private")
NORMS_ONLY = ["loss", "grad_norm", "layer_grad_norm"]
VOCABULARY = 1024
# Buffers of 256 KiB and more are mapped on their own and handed back to the system when
# freed (glibc otherwise raises this threshold as large buffers are freed, and keeps them
# in its heap): the RSS after the first step is then what lives between steps, and the
# peak of the later steps is theirs, not the first step's left in the heap.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}

# Small configs that train on a 2-core CPU at T = 4096 (batch 2, two heads: the
# attention scores, B * heads * T^2 floats per layer, are the plain step's largest).
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "num_layers": 2,
        "num_heads": 2,
        "hidden_dim": 128,
        "intermediate_dim": 512,
        "dropout": 0.0,
    },
    "qwen3": {
        "num_layers": 2,
        "num_query_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "hidden_dim": 128,
        "intermediate_dim": 512,
        "dropout": 0.0,
    },
}


def causal_lm(name: str, length: int, tracked: bool, lora_rank: int = 0) -> Any:
    """The model `name` of `MODELS` at sequence length `length`, compiled; with
    `GradientTrackingMixin` in front when `tracked`; with `lora_rank`, its backbone's
    LoRA enabled at that rank (only the factors, and the biases Keras leaves trainable,
    train)."""
    import keras
    import keras_hub

    import keras_gradtrack as kgt

    keras.utils.set_random_seed(0)
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCABULARY, max_sequence_length=length, **MODELS[name]
        )
        task = keras_hub.models.GPT2CausalLM
    else:
        backbone = keras_hub.models.Qwen3Backbone(vocabulary_size=VOCABULARY, **MODELS[name])
        task = keras_hub.models.Qwen3CausalLM
    if lora_rank:
        backbone.enable_lora(lora_rank)
    if tracked:
        task = type(f"Tracked{task.__name__}", (kgt.GradientTrackingMixin, task), {})
    model = task(backbone, preprocessor=None)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def token_batches(batches: int, batch_size: int, length: int) -> tuple[dict[str, Any], Any]:
    """`batches` batches of random token ids, every position unpadded; the targets are
    the next tokens."""
    import numpy as np

    ids = np.random.default_rng(0).integers(1, VOCABULARY, (batches * batch_size, length))
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones(ids.shape, bool)}
    return x, np.roll(ids, -1, axis=1).astype("int32")


# -- the child: one variant in a fresh process ------------------------------------------


def memory_in_use_mib() -> float:
    """CPU: the process's RSS now; GPU (JAX): the allocator's bytes in use."""
    device = gpu_memory_stats()
    if device is not None:
        return device["bytes_in_use"] / 2**20
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def reset_peak() -> None:
    """Resets the kernel's peak-RSS mark (`ru_maxrss`) to the current RSS (CPU only)."""
    if gpu_memory_stats() is None:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")


def peak_mib() -> float:
    device = gpu_memory_stats()
    if device is not None:
        return device["peak_bytes_in_use"] / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gpu_memory_stats() -> dict[str, int] | None:
    import keras

    if keras.backend.backend() != "jax":
        return None
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats if "peak_bytes_in_use" in stats else None


class RecordedStep:
    """A jitted train step that keeps the shapes of its first call's arguments, so that
    XLA's buffer assignment for it can be read after `fit` (the arguments themselves are
    donated)."""

    def __init__(self, jitted: Any) -> None:
        self.jitted = jitted
        self.shapes: Any = None

    def __call__(self, *args: Any) -> Any:
        if self.shapes is None:
            import jax

            def shape_of(leaf: Any) -> Any:
                if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                return leaf

            self.shapes = jax.tree.map(shape_of, args)
        return self.jitted(*args)


def record_compiled_steps() -> list[RecordedStep]:
    """From now on, every train step that Keras' JAX trainer or the tracking mixin jits
    (a `jax.jit` donating its state, argument 0) is a `RecordedStep` in the list."""
    import jax
    from keras.src.backend.jax import trainer

    steps: list[RecordedStep] = []
    jit = jax.jit

    def recording_jit(fun: Any, *args: Any, **kwargs: Any) -> Any:
        jitted = jit(fun, *args, **kwargs)
        if kwargs.get("donate_argnums") != 0:
            return jitted
        steps.append(RecordedStep(jitted))
        return steps[-1]

    jax.jit = recording_jit
    trainer.jit = recording_jit
    return steps


def compiled_step_memory(steps: list[RecordedStep]) -> dict[str, float]:
    """`step_mib`: XLA's buffer assignment for the train step the `fit`s ran (the
    largest, if several ran): its arguments, its outputs not aliasing (donated into)
    them and its temporaries, which is as much as the step can hold at once, whatever
    the allocator does between steps. What compiling takes is the host's, not counted."""
    found = 0.0
    for step in steps:
        if step.shapes is None:
            continue  # never called: the untracked step of a tracked fit
        analysis = step.jitted.lower(*step.shapes).compile().memory_analysis()
        step_bytes = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes
        )
        found = max(found, step_bytes / 2**20)
    return {"step_mib": found}


def layer_forms(model: Any, backend: str) -> dict[str, str]:
    """Tracked layer -> the form its rule took (TensorFlow: the last traced step's
    `direct`/`materialized`, `direct` on sequences being the Gram form; JAX: the plan's
    path)."""
    if backend == "tensorflow":
        return dict(model.gradient_tracking.forms)
    from keras_gradtrack.backends.jax.coupled import coupled_path

    return {t.name: coupled_path(model, t) for t in model.gradient_tracking_plan()}


def use_compilation_cache(directory: str) -> None:
    """JAX keeps every compiled program in `directory` and reads it back from there."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("cache_dir"):
        use_compilation_cache(spec["cache_dir"])
    import keras

    from keras_gradtrack import statistics as kgt_statistics

    backend = keras.backend.backend()
    variant, length, batch_size = spec["variant"], spec["length"], spec["batch_size"]
    steps_compiled = record_compiled_steps() if backend == "jax" else []
    model = causal_lm(spec["model"], length, variant != "plain", spec.get("lora", 0))
    x, y = token_batches(max(spec["steps"], 1), batch_size, length)
    if variant == "private":
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    elif variant != "plain":
        names = NORMS_ONLY if variant == "norms" else None
        reader = BlockReader()  # reads the values to the host, as a logger does
        model.gradient_tracking.subscribe(
            "bench", kgt_statistics.resolve(names), 1, reader.consume, finish=reader.read
        )
    times: list[float] = []

    class StepTimes(keras.callbacks.Callback):
        """Seconds of each step, each waited for by reading the step counter."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            keras.ops.convert_to_numpy(self.model.optimizer.iterations)
            times.append(time.perf_counter() - self.start)

    def fit(steps: int) -> float:
        """Runs a `fit` of `steps` steps; the peak growth of memory during it, MiB."""
        before = memory_in_use_mib()
        reset_peak()
        model.fit(
            x,
            y,
            batch_size=batch_size,
            steps_per_epoch=steps,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[StepTimes()],
        )
        return peak_mib() - before

    first = fit(1)  # traces (compiles) the step and runs it once
    # TensorFlow traces the tracked step once more at its second `fit` (not the plain
    # one): a second warm-up keeps that out of the measured steps.
    fit(1)
    del times[:]
    step = fit(spec["steps"])
    row: dict[str, Any] = {"ms": 1000 * statistics.median(times), "first_mib": first, "mib": step}
    if steps_compiled:
        row.update(compiled_step_memory(steps_compiled))
    if variant != "plain":
        row["forms"] = layer_forms(model, backend)
    return row


# -- the parent --------------------------------------------------------------------------


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs `spec` in a fresh process of its backend; its row, or the error it printed.
    With `warm_compile` (JAX), a first process fills a compilation cache of its own and
    the row is that of a second one, which reads every compiled program from it: its
    first `fit` then holds no compiling."""
    if spec.get("warm_compile") and spec["backend"] == "jax":
        with tempfile.TemporaryDirectory() as directory:
            cached = {**spec, "warm_compile": False, "cache_dir": directory}
            first = run_child(cached)
            return first if "error" in first else run_child(cached)
    env = {**os.environ, "KERAS_BACKEND": spec["backend"], "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.update(MALLOC_SETTINGS)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith(MESSAGE_PREFIX):
            return dict(json.loads(line[len(MESSAGE_PREFIX) :]))
    return {"error": result.stderr[-3000:]}


def form_summary(forms: dict[str, str]) -> str:
    """`name: form` per distinct form, the layers counted: `materialized 12, direct 2`."""
    counts: dict[str, int] = {}
    for form in forms.values():
        counts[form] = counts.get(form, 0) + 1
    return ", ".join(f"{form} {count}" for form, count in sorted(counts.items()))


def cell(found: dict[str, Any], key: str, digits: int = 0) -> str:
    return "failed" if "error" in found else f"{found[key]:.{digits}f}"


def ratio(found: dict[str, Any], plain: dict[str, Any], key: str) -> str:
    if "error" in found or "error" in plain or plain[key] <= 0:
        return "-"
    return f"{found[key] / plain[key]:.2f}x"


def compiled_cells(found: dict[str, Any], plain: dict[str, Any]) -> str:
    """The XLA step's buffers, plain / tracked (ratio): JAX only."""
    if "step_mib" not in found or "step_mib" not in plain:
        return "-"
    return f"{plain['step_mib']:.0f} / {found['step_mib']:.0f} ({ratio(found, plain, 'step_mib')})"


def table_rows(
    model: str, length: int, backend: str, found: dict[str, dict[str, Any]]
) -> list[str]:
    plain = found["plain"]
    rows = []
    for variant in found:
        if variant == "plain":
            continue
        tracked = found[variant]
        rows.append(
            f"| {model} | {length} | {backend} | {variant} | {cell(plain, 'ms', 1)} "
            f"| {cell(tracked, 'ms', 1)} | {ratio(tracked, plain, 'ms')} "
            f"| {cell(plain, 'first_mib')} | {cell(tracked, 'first_mib')} "
            f"| {ratio(tracked, plain, 'first_mib')} | {cell(plain, 'mib', 1)} "
            f"| {cell(tracked, 'mib', 1)} | {compiled_cells(tracked, plain)} "
            f"| {form_summary(tracked.get('forms', {}))} |"
        )
    return rows


HEADER = (
    "| model | T | backend | statistics | plain ms | tracked ms | time ratio | plain MiB "
    "| tracked MiB | memory ratio | later steps plain MiB | later steps tracked MiB "
    "| XLA step buffers MiB plain / tracked | forms (layers) |\n"
    "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
    "| ---: | --- |"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seq-lens", default="128,512,1024")
    parser.add_argument("--backends", default="tensorflow,jax")
    parser.add_argument(
        "--variants",
        default="tracked",
        help="besides plain: tracked (default statistics), norms, private (make_private, sigma 1)",
    )
    parser.add_argument(
        "--lora", type=int, default=0, help="enable LoRA at this rank on every variant's backbone"
    )
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument(
        "--warm-compile",
        action="store_true",
        help="JAX: measure each variant in a process whose programs come from a "
        "compilation cache a first process filled (the first fit without compiling)",
    )
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row = child(json.loads(args.child))
        print(MESSAGE_PREFIX + json.dumps(row), flush=True)
        return
    load = os.getloadavg()[0]
    begin = time.time()
    lines = [HEADER]
    for backend in args.backends.split(","):
        for name in args.models.split(","):
            for length in (int(t) for t in args.seq_lens.split(",")):
                found = {}
                for variant in ("plain", *args.variants.split(",")):
                    spec = {
                        "model": name,
                        "length": length,
                        "backend": backend,
                        "variant": variant,
                        "batch_size": args.batch_size,
                        "steps": args.steps,
                        "lora": args.lora,
                        "warm_compile": args.warm_compile,
                    }
                    found[variant] = run_child(spec)
                    if "error" in found[variant]:
                        print(f"{spec} failed:\n{found[variant]['error']}", file=sys.stderr)
                    else:
                        print(f"{spec}: {found[variant]}", file=sys.stderr, flush=True)
                label = f"{name} + LoRA {args.lora}" if args.lora else name
                lines += table_rows(label, length, backend, found)
    note = (
        f"B={args.batch_size}, {args.steps} timed steps; load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {(time.time() - begin) / 60:.1f} min; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    text = "\n".join([note, "", *lines]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

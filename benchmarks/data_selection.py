"""LESS-style data selection from logged LoRA gradient sketches, and what logging costs.

LESS (Xia et al. 2024, "LESS: Selecting Influential Data for Targeted Instruction
Tuning") picks, from a mixed pool, the examples whose LoRA gradients point the way a
small target set's do: per-example gradients, randomly projected, ranked by cosine
similarity to the targets' projected gradients, summed over checkpoints. Here:

* **Model.** A keras_hub GPT-2 causal LM from a config (2 layers, 2 heads, width 32,
  random weights, nothing downloaded), `backbone.enable_lora(4)`: the query and value
  projections' LoRA factors and biases train. Adam, next-token cross-entropy (the last
  position has sample weight 0).
* **Pool.** `--pool` sequences of `--length` tokens, a quarter from each of four tasks,
  shuffled. Each task draws from a window of `2(V-1)/5` tokens (`V = --vocabulary`)
  that overlaps the next task's by half (`task_window`): `copy` (h = length/2 uniform
  tokens, then the same h again), `reverse` (h uniform tokens, then them reversed),
  `arithmetic` (`x_k = first + (a + k d) mod size`, uniform start a, step d != 0) and
  `successor` (a uniform first token, then `x_{k+1} = pi(x_k)` for one fixed random
  permutation pi of the window).
* **Targets.** For each task, `--targets` fresh sequences of it, never trained on.
* **Selection.** A warm-up with LoRA on a random 5% of the pool (as LESS), then
  `--epochs` epochs on the whole pool with `HDF5GradientLogger(sketch_dim=...)`: each
  example's gradient sketch at its step's weights, and the weights at each epoch's first
  step. At each of those checkpoints `kgt.attribution.sketch_examples` sketches the
  targets the same way (the log's projections, the same loss and sample weights;
  inference mode, which with dropout 0 is training's). A pool example's
  score is the sum over its logged rows of the **mean over the targets** of the cosine
  of its row's sketch with each target's at the row's checkpoint (LESS's code averages
  over a task's validation examples, then takes the max over tasks; `--reduce max`
  takes the max over targets). The learning rate is constant, so LESS's weighting of
  checkpoints by it changes nothing; LESS preconditions the pool's gradients with Adam's
  moments, these are plain gradients.
* **Printed.** Per target task, precision at k against the known task (k = the task's
  count in the pool, and 10% of the pool) of LESS's ranking and of a random one. Then
  the median step of plain keras_hub `fit`, of a tracked `fit` logging the loss, and of
  one logging the sketches too (same weights and data; paired interleaved rounds), and
  the peak RSS growth of a `fit` of each after the rounds.

```
python benchmarks/data_selection.py                       # ~1 min on 2 CPU cores
python benchmarks/data_selection.py --pool 1024 --sketch-dim 16 --epochs 2
python benchmarks/data_selection.py --no-timing --reduce max
```
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np

import keras_gradtrack as kgt

TASKS = ("copy", "reverse", "arithmetic", "successor")
GPT2 = {"num_layers": 2, "num_heads": 2, "hidden_dim": 32, "intermediate_dim": 64, "dropout": 0.0}
LOGGED = ["loss"]  # the cheapest statistic: the sketches are what selection reads
WARMUP_STEPS = 2  # dropped at the start of every timed `fit`
# Timed: plain keras_hub `fit`; tracked with a logger of the loss alone; and with sketches.
VARIANTS = ("plain", "logged", "sketched")


# -- the data ---------------------------------------------------------------------------


def task_window(task: str, vocabulary: int) -> tuple[int, int]:
    """`(first, size)`: the tokens `first..first+size-1` the task draws from. The tasks'
    windows, in `TASKS` order, each overlap the next by half."""
    size = 2 * (vocabulary - 1) // (len(TASKS) + 1)
    return 1 + TASKS.index(task) * size // 2, size


def task_sequences(task: str, count: int, length: int, vocabulary: int, seed: int) -> np.ndarray:
    """`count` sequences of `task` (see the module docstring), int32 `(count, length)`.
    `successor`'s permutation depends on `vocabulary` alone, so the pool and the targets
    share it."""
    if task not in TASKS:
        raise ValueError(f"Expected a task among {TASKS}. Received: task={task!r}")
    rng = np.random.default_rng(seed)
    first, size = task_window(task, vocabulary)
    half = length // 2
    if task in ("copy", "reverse"):
        opening = rng.integers(0, size, (count, half))
        closing = opening if task == "copy" else opening[:, ::-1]
        offsets = np.concatenate([opening, closing, opening[:, : length - 2 * half]], axis=1)
    elif task == "arithmetic":
        start = rng.integers(0, size, (count, 1))
        step = rng.integers(1, size, (count, 1))
        offsets = (start + step * np.arange(length)) % size
    else:
        successor = np.random.default_rng(vocabulary).permutation(size)
        offsets = np.empty((count, length), np.int64)
        offsets[:, 0] = rng.integers(0, size, count)
        for position in range(1, length):
            offsets[:, position] = successor[offsets[:, position - 1]]
    return (first + offsets).astype(np.int32)


def next_tokens(ids: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """`(x, y, sample_weight)` of next-token prediction of `ids`."""
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    weight = np.ones(ids.shape, "float32")
    weight[:, -1] = 0.0  # the last token has no next one
    return x, np.roll(ids, -1, axis=1), weight


def fit_on(model: Any, ids: np.ndarray, example_ids: Any, **kwargs: Any) -> None:
    """`model.fit` on next-token prediction of `ids`, in order, quietly; `x` holds the
    `example_ids` unless they are None (a plain Keras model would pass them on)."""
    x, y, weight = next_tokens(ids)
    if example_ids is not None:
        x["example_id"] = example_ids
    model.fit(x, y, sample_weight=weight, shuffle=False, verbose=0, **kwargs)


@dataclasses.dataclass
class Data:
    pool: np.ndarray  # (n, length) token ids; example id = row
    source: np.ndarray  # (n,) index into TASKS
    targets: dict[str, np.ndarray]  # per target task, (t, length), not in the pool


def make_data(args: argparse.Namespace) -> Data:
    share = args.pool // len(TASKS)
    parts = [
        task_sequences(task, share, args.length, args.vocabulary, args.seed + 1 + index)
        for index, task in enumerate(TASKS)
    ]
    order = np.random.default_rng(args.seed).permutation(share * len(TASKS))
    source = np.repeat(np.arange(len(TASKS)), share)[order]
    pool = np.concatenate(parts)[order]
    targets = {
        task: task_sequences(
            task, args.targets, args.length, args.vocabulary, 99 + TASKS.index(task)
        )
        for task in args.target_tasks
    }
    return Data(pool, source, targets)


# -- the model --------------------------------------------------------------------------


def build(args: argparse.Namespace, tracked: bool) -> Any:
    """The LoRA causal LM (random weights from `args.seed`), compiled."""
    import keras_hub

    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocabulary, max_sequence_length=args.length, **GPT2
    )
    backbone.enable_lora(4)
    model_class = keras_hub.models.GPT2CausalLM
    if tracked:
        model_class = type("TrackedGPT2CausalLM", (kgt.GradientTrackingMixin, model_class), {})
    model = model_class(backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


# -- the selection ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolRows:
    """The logged rows of the pool's fine-tuning: one per example and epoch."""

    example_id: np.ndarray  # (N,)
    step: np.ndarray  # (N,) the step that logged the row
    sketch: np.ndarray  # (N, K) the example's gradient sketch at that step's weights


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms > 0, norms, 1.0)


def less_scores(
    pool: PoolRows, target_sketches: dict[int, np.ndarray], pool_size: int, reduce: str
) -> np.ndarray:
    """Per pool example (by id), the sum over its logged rows of the mean (or max) over
    targets of `cos(row's sketch, target's sketch at the row's checkpoint)`: the last
    checkpoint at or before the row's step."""
    rows = unit_rows(pool.sketch.astype(np.float64))
    steps = np.array(sorted(target_sketches))
    checkpoint = np.maximum(np.searchsorted(steps, pool.step, side="right") - 1, 0)
    per_row = np.empty(len(rows))
    for index, step in enumerate(steps):
        of_checkpoint = checkpoint == index
        cosines = rows[of_checkpoint] @ unit_rows(target_sketches[step].astype(np.float64)).T
        per_row[of_checkpoint] = cosines.max(1) if reduce == "max" else cosines.mean(1)
    return np.bincount(pool.example_id, per_row, minlength=pool_size)


@dataclasses.dataclass(frozen=True)
class Selection:
    """One target task's ranking of the pool, against its known source."""

    scores: np.ndarray  # (n,) LESS score per pool example, by id
    relevant: np.ndarray  # (n,) bool: from the target task
    ks: tuple[int, int]  # the target task's count in the pool, 10% of the pool

    def precision(self, ranking: np.ndarray) -> list[float]:
        """Precision at each of `ks` of `ranking` (ids, best first)."""
        return [float(self.relevant[ranking[:k]].mean()) for k in self.ks]

    @property
    def ranking(self) -> np.ndarray:
        return np.argsort(-self.scores, kind="stable")


@dataclasses.dataclass(frozen=True)
class Run:
    """What selection reads: the pool's logged rows and each target task's sketches."""

    data: Data
    pool: PoolRows
    target_sketches: dict[str, dict[int, np.ndarray]]  # task -> {checkpoint step: (t, K)}


def fine_tune(args: argparse.Namespace, out: Path) -> Run:
    """Warm-up, the logged fine-tuning on the pool, and every target task's targets
    sketched at each of its checkpoints. One fine-tuning serves every target task."""
    data = make_data(args)
    model = build(args, tracked=True)
    rng = np.random.default_rng(args.seed)
    count = max(args.batch_size, round(args.warmup_fraction * len(data.pool)))
    warmup = rng.choice(len(data.pool), count, replace=False)
    fit_on(model, data.pool[warmup], warmup, batch_size=args.batch_size, epochs=args.warmup_epochs)

    path = out / "pool.h5"
    logger = kgt.HDF5GradientLogger(
        path, statistics=LOGGED, sketch_dim=args.sketch_dim, sketch_seed=args.seed, overwrite=True
    )
    every_id = np.arange(len(data.pool))
    fit_on(
        model,
        data.pool,
        every_id,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[logger],
    )
    with kgt.GradientLog(path) as log:
        pool = PoolRows(
            *(log.per_example(name) for name in ("example_id", "step", "gradient_sketch"))
        )
        # Every task's targets in one call: one trace, one load of each checkpoint.
        every_target = np.concatenate(list(data.targets.values()))
        sketches = kgt.attribution.sketch_examples(
            log, model, *next_tokens(every_target), batch_size=args.batch_size
        )
    ends = np.cumsum([len(targets) for targets in data.targets.values()])
    target_sketches = {
        task: {step: np.split(found, ends[:-1])[index] for step, found in sketches.items()}
        for index, task in enumerate(data.targets)
    }
    return Run(data, pool, target_sketches)


def rank(run: Run, reduce: str = "mean") -> dict[str, Selection]:
    """Each target task's ranking of the pool by its LESS scores."""
    selections = {}
    size = len(run.data.pool)
    for task, sketches in run.target_sketches.items():
        relevant = run.data.source == TASKS.index(task)
        ks = (int(relevant.sum()), max(1, round(0.1 * size)))
        selections[task] = Selection(less_scores(run.pool, sketches, size, reduce), relevant, ks)
    return selections


# -- the cost ---------------------------------------------------------------------------


def time_steps(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Per variant (`VARIANTS`): the median seconds per step, its median ratio to plain's
    over paired interleaved rounds, and the peak RSS growth (MiB) of a `fit` after them."""
    from report import StepTimes

    data = make_data(args)
    models = {variant: build(args, tracked=variant != "plain") for variant in VARIANTS}
    steps = args.steps + WARMUP_STEPS

    # One logger per variant for all its `fit`s (each continues the file): one trace each.
    sketch_dims = {"logged": None, "sketched": args.sketch_dim}
    loggers = {
        variant: kgt.HDF5GradientLogger(out / f"{variant}.h5", LOGGED, sketch_dim=dim)
        for variant, dim in sketch_dims.items()
    }

    def fit(variant: str, count: int) -> list[float]:
        timer = StepTimes()
        callbacks = [loggers[variant], timer] if variant in loggers else [timer]
        ids = np.resize(data.pool, (count * args.batch_size, args.length))  # repeats the pool
        example_ids = None if variant == "plain" else np.arange(len(ids))
        fit_on(models[variant], ids, example_ids, batch_size=args.batch_size, callbacks=callbacks)
        return timer.times[WARMUP_STEPS:]

    for variant in VARIANTS:  # traced before the rounds
        fit(variant, WARMUP_STEPS + 1)
    rounds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        first = round_index % len(VARIANTS)  # each round starts with another variant
        for variant in VARIANTS[first:] + VARIANTS[:first]:
            rounds[variant].append(statistics.median(fit(variant, steps)))
    return {
        variant: {
            "seconds": statistics.median(rounds[variant]),
            "ratio": statistics.median(np.divide(rounds[variant], rounds["plain"])),
            "memory": peak_rss_growth(lambda variant=variant: fit(variant, steps)),
        }
        for variant in VARIANTS
    }


def peak_rss_growth(run: Any) -> float:
    """Peak RSS during `run()` over the RSS before it, MiB (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            before = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets the peak-RSS mark to the current RSS
    except OSError:
        return float("nan")
    run()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


# -- the report -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=256, help="pool size (equal task shares)")
    parser.add_argument("--targets", type=int, default=16, help="target examples per task")
    parser.add_argument("--target-tasks", type=lambda text: text.split(","), default=list(TASKS))
    parser.add_argument("--length", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--vocabulary", type=int, default=64)
    parser.add_argument("--sketch-dim", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-fraction", type=float, default=0.05, help="of the pool")
    parser.add_argument("--warmup-epochs", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1, help="logged epochs on the pool")
    parser.add_argument("--reduce", choices=("mean", "max"), default="mean")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--no-timing", action="store_true", help="the selection alone")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def selection_table(selections: dict[str, Selection], seed: int) -> str:
    """Markdown: per target task, LESS's and a random ranking's precision at both ks."""
    lines = [
        "| target task | k | LESS precision@k | random precision@k | LESS precision@10% "
        "| random precision@10% | share (random, expected) |",
        "|" + " --- |" * 7,
    ]
    for task, selection in selections.items():
        random_ranking = np.random.default_rng(seed + 1000).permutation(len(selection.scores))
        less, random = selection.precision(selection.ranking), selection.precision(random_ranking)
        lines.append(
            f"| {task} | {selection.ks[0]} | {less[0]:.2f} | {random[0]:.2f} | {less[1]:.2f} "
            f"| {random[1]:.2f} | {selection.relevant.mean():.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="data-selection-") as directory:
        selections = rank(fine_tune(args, Path(directory)), args.reduce)
        cost = None if args.no_timing else time_steps(args, Path(directory))
    k = next(iter(selections.values())).ks[1]
    print(
        f"pool {args.pool} sequences of {args.length} tokens ({', '.join(TASKS)}), "
        f"{args.targets} targets per task, sketch dim {args.sketch_dim}, {args.epochs} "
        f"logged epoch(s), cosine {args.reduce} over targets; 10% of the pool: k = {k}\n"
    )
    print(selection_table(selections, args.seed))
    if cost is not None:
        names = {
            "plain": "plain LoRA (keras_hub `fit`)",
            "logged": "tracked, logging the loss",
            "sketched": f"tracked, logging the loss and sketches (dim {args.sketch_dim})",
        }
        print("\n| step | ms | / plain | peak RSS growth MiB |\n| --- | --- | --- | --- |")
        for variant, found in cost.items():
            print(
                f"| {names[variant]} | {found['seconds'] * 1e3:.1f} | {found['ratio']:.2f}x "
                f"| {found['memory']:.1f} |"
            )


if __name__ == "__main__":
    main()

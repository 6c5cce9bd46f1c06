"""Attribution (TracIn on targets): what it costs, what it finds, how well sketches rank.

Three measurements, each a markdown table:

* `cost`: the time per training step of plain `keras.Model.fit`, of tracked `fit` with
  `HDF5GradientLogger` (the default statistics), and of the same with 64 and 256 targets
  (`targets=`) and with gradient sketches (`sketch_dim=`), on the MLP and the CNN of
  `overhead.py` at B=128. Interleaved rounds; ratios are medians of per-round ratios, of
  wall-clock time and of the process's CPU time (steadier on a loaded machine).
  The row "plain + the 64 targets' pass" is plain fit plus the targets' own forward
  (inference mode) and backward pass to each weighted layer's output, every step,
  without per-example gradients or products: the floor of exact targets at each step's
  weights.
* `digits`: scikit-learn's digits, 15% of the training labels flipped, 200 clean held-out
  targets, an MLP 64-64-10 trained with SGD (momentum 0.9) for 10 epochs; exact influence
  on every target. For the mispredicted targets, the share of flipped labels among their
  top-10 opponents; for all targets, how often the top-10 proponents share the target's
  label; the summed opponent score as a mislabel detector (ROC AUC).
* `sketch` (with `digits`): the same targets "chosen after training": influence estimated
  from gradient sketches and checkpoints, at each sketch size offered, against the exact
  scores: Spearman correlation per target (median over targets), overlap of the top-10
  proponents and opponents, and the flipped share among the estimated top-10 opponents.
  Dim 64 projects nothing on this MLP (no side is larger): its rows show what the
  checkpoints alone cost (their weights in place of each step's).

```
python benchmarks/attribution.py                    # all of it (~10 min on 2 cores)
python benchmarks/attribution.py cost --rounds 3
python benchmarks/attribution.py digits --epochs 3 --sketch-dims 4,16
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
import tensorflow as tf

import keras_gradtrack as kgt
from keras_gradtrack import analysis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import build_compiled, synthetic_batches

TOP = 10


def load_average() -> str:
    """`uptime`'s load averages: timings are only comparable on a quiet machine."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


# -- cost -------------------------------------------------------------------------------


class StepClock(keras.callbacks.Callback):
    """Wall-clock and CPU time of each step (the CPU time of all of the process's
    threads moves less with other processes' load than the wall clock does)."""

    def __init__(self) -> None:
        super().__init__()
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._begin = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.wall.append(time.perf_counter() - self._begin[0])
        self.cpu.append(time.process_time() - self._begin[1])


def step_times(model: Any, dataset: Any, steps: int, loggers: list[Any]) -> tuple[float, float]:
    """Median wall and CPU seconds per step over `steps` steps (after 2 dropped ones)."""
    clock = StepClock()
    # The clock last: a step's time includes the logger's work.
    model.fit(dataset, steps_per_epoch=steps + 2, verbose=0, callbacks=[*loggers, clock])
    return statistics.median(clock.wall[2:]), statistics.median(clock.cpu[2:])


class WithTargetsPass(keras.Model):
    """Plain Keras fit plus, every step, the targets' forward pass (inference mode) and
    backward pass to every weighted layer's output: the least any exact method pays
    for targets at each step's weights (no per-example gradients, no products)."""

    def set_targets(self, x: Any, y: Any) -> None:
        outputs = [layer.output for layer in self.layers if layer.trainable_weights]
        self.probe = keras.Model(self.inputs, outputs)
        self.targets = (tf.constant(x), tf.constant(y))

    def train_step(self, data: Any) -> Any:
        logs = super().train_step(data)
        x, y = self.targets
        with tf.GradientTape() as tape:
            outputs = self.probe(x, training=False)
            loss = self.loss(y, outputs[-1])
        grads = tape.gradient(loss, outputs)
        # Kept in the step's outputs, so that the pass is not pruned.
        return {**logs, "targets_pass": tf.add_n([tf.reduce_sum(g) for g in grads])}


def measure_cost(model_name: str, batch_size: int, targets: list[int], sketch_dim: int,
                 steps: int, rounds: int, out: Path) -> list[tuple[str, float, float, float]]:  # fmt: skip
    """`(variant, wall ms per step, wall and CPU ratio to plain)`, interleaved over rounds."""
    keras.utils.set_random_seed(0)
    plain = build_compiled(model_name, keras.Model)
    batches = synthetic_batches(model_name, batch_size)
    dataset = tf.data.Dataset.from_tensor_slices(batches).batch(batch_size).repeat().prefetch(2)
    x, y = next(iter(dataset))
    variants: dict[str, tuple[Any, list[Any]]] = {"plain": (plain, [])}

    def tracked(name: str, **logger: Any) -> None:
        model = build_compiled(model_name, kgt.GradientTrackingModel)
        model.set_weights(plain.get_weights())
        # One logger per variant, reused by every fit: its step is traced once.
        variants[name] = (model, [kgt.HDF5GradientLogger(out / f"{model_name}_{name}.h5",
                                                          overwrite=True, **logger)])  # fmt: skip

    tracked("tracked")
    for count in targets:
        tracked(f"+{count} targets", targets=(x.numpy()[:count], y.numpy()[:count]))
    tracked(f"+sketch dim {sketch_dim}", sketch_dim=sketch_dim)
    if targets:
        floor = build_compiled(model_name, WithTargetsPass)
        floor.set_weights(plain.get_weights())
        floor.set_targets(x.numpy()[: targets[0]], y.numpy()[: targets[0]])
        variants[f"plain + the {targets[0]} targets' pass"] = (floor, [])
    for model, loggers in variants.values():
        step_times(model, dataset, 3, loggers)  # traces
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, loggers) in variants.items():
            per_round[name].append(step_times(model, dataset, steps, loggers))
    rows = []
    for name, times in per_round.items():
        wall = [t[0] / p[0] for t, p in zip(times, per_round["plain"])]
        cpu = [t[1] / p[1] for t, p in zip(times, per_round["plain"])]
        milliseconds = 1000 * statistics.median(t[0] for t in times)
        rows.append((name, milliseconds, statistics.median(wall), statistics.median(cpu)))
    return rows


def cost_table(args: argparse.Namespace, out: Path) -> str:
    lines = [
        f"### Cost per training step, B={args.batch_size} ({load_average()} at the start)",
        "",
        "| model | variant | ms/step | / plain (wall) | / plain (CPU time) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in args.models.split(","):
        print(f"cost: {name}", file=sys.stderr, flush=True)
        targets = [int(t) for t in args.targets.split(",")]
        for variant, ms, wall, cpu in measure_cost(
            name, args.batch_size, targets, args.cost_sketch_dim, args.steps, args.rounds, out
        ):
            lines.append(f"| {name} | {variant} | {ms:.1f} | {wall:.2f}x | {cpu:.2f}x |")
    return "\n".join(lines)


# -- digits: what influence finds, and sketches against exact -----------------------------


def digits_split(flip_fraction: float, held_out: int, seed: int) -> dict[str, np.ndarray]:
    """Training examples (labels partly flipped) and clean held-out targets."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, train = order[:held_out], order[held_out:]
    flipped = rng.random(len(train)) < flip_fraction
    logged = y[train].copy()
    logged[flipped] = (logged[flipped] + rng.integers(1, 10, flipped.sum())) % 10
    return {"x": x[train], "y": logged, "true": y[train], "flipped": flipped,
            "x_test": x[test], "y_test": y[test]}  # fmt: skip


def digits_model() -> Any:
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(10)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.02, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def rank(values: np.ndarray) -> np.ndarray:
    ranks = np.empty(len(values))
    ranks[np.argsort(values, kind="stable")] = np.arange(len(values))
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def findings(influence: Any, data: dict[str, np.ndarray], wrong: np.ndarray) -> dict[str, float]:
    """What the scores say about the flipped labels and the targets' labels."""
    flipped_ids = set(np.flatnonzero(data["flipped"]).tolist())
    opponent_share = [
        np.mean([i in flipped_ids for i in influence.opponents(int(t), TOP).example_id])
        for t in wrong
    ]
    same_label = [
        np.mean(data["y"][influence.proponents(int(t), TOP).example_id] == data["y_test"][t])
        for t in influence.target_ids
    ]
    toward_prediction = [
        np.mean(data["y"][influence.opponents(int(t), TOP).example_id] == data["predicted"][t])
        for t in wrong
    ]
    summed = analysis.ExampleScores(
        "opposition", influence.train_ids, -influence.scores.sum(axis=1), influence.rows
    )
    detection = analysis.detection_metrics(summed, flipped_ids)
    return {
        "flipped among top-10 opponents (mispredicted targets)": float(np.mean(opponent_share)),
        "top-10 proponents with the target's label (all targets)": float(np.mean(same_label)),
        "top-10 opponents trained with the predicted label (mispredicted)": float(
            np.mean(toward_prediction)
        ),
        "ROC AUC of -sum over targets (mislabel detector)": detection.roc_auc,
    }


def digits_tables(args: argparse.Namespace, out: Path) -> str:
    dims = [int(d) for d in args.sketch_dims.split(",")] if args.sketch_dims else []
    data = digits_split(args.flip_fraction, args.held_out, args.seed)
    keras.utils.set_random_seed(args.seed)
    model = digits_model()
    targets = ({"pixels": data["x_test"], "example_id": np.arange(len(data["y_test"]))},
               data["y_test"])  # fmt: skip
    loggers = [kgt.HDF5GradientLogger(out / "digits_exact.h5", overwrite=True, targets=targets)]
    for dim in dims:
        for every in (None, args.checkpoint_every):
            name = f"digits_sketch{dim}_{'epoch' if every is None else every}.h5"
            loggers.append(kgt.HDF5GradientLogger(out / name, overwrite=True, sketch_dim=dim,
                                                  checkpoint_every=every))  # fmt: skip
    start = time.perf_counter()
    model.fit({"pixels": data["x"], "example_id": np.arange(len(data["y"]))}, data["y"],
              batch_size=args.batch_size, epochs=args.epochs, verbose=0, callbacks=loggers)  # fmt: skip
    print(f"digits: trained in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    data["predicted"] = np.argmax(model.predict(data["x_test"], verbose=0), axis=1)
    wrong = np.flatnonzero(data["predicted"] != data["y_test"])
    with kgt.GradientLog(out / "digits_exact.h5") as log:
        exact = log.influence()
    lines = [
        f"### Digits: {len(data['y'])} training examples ({data['flipped'].mean():.1%} flipped), "
        f"{len(data['y_test'])} clean targets, {len(wrong)} mispredicted; {args.epochs} epochs",
        "",
        "| scores | " + " | ".join(findings(exact, data, wrong)) + " |",
        "| --- |" + " --- |" * 4,
    ]
    rows = {"exact": findings(exact, data, wrong)}
    comparisons = []
    for dim in dims:
        for every in (None, args.checkpoint_every):
            label = f"sketch dim {dim}, checkpoints every {'epoch' if every is None else f'{every} steps'}"
            name = f"digits_sketch{dim}_{'epoch' if every is None else every}.h5"
            with kgt.GradientLog(out / name) as log:
                estimate = kgt.attribution.estimate_influence(log, digits_model(), targets)
                width = log.layout.widths("per_example")["gradient_sketch"]
            rows[label] = findings(estimate, data, wrong)
            comparisons.append((label, width, compare(exact, estimate)))
    for label, values in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in values.values()) + " |")
    lines += [
        "",
        f"### Sketched against exact scores (exact gradient: {exact_size()} numbers per example)",
        "",
        "| sketch | numbers per example | median Spearman | top-10 proponents shared | "
        "top-10 opponents shared |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, width, (rho, proponents, opponents) in comparisons:
        lines.append(f"| {label} | {width} | {rho:.3f} | {proponents:.2f} | {opponents:.2f} |")
    return "\n".join(lines)


def exact_size() -> int:
    return digits_model().count_params()


def compare(exact: Any, estimate: Any) -> tuple[float, float, float]:
    """Median Spearman over targets, mean top-10 overlaps (proponents, opponents)."""
    rhos, proponents, opponents = [], [], []
    for j, target in enumerate(exact.target_ids):
        rhos.append(spearman(exact.scores[:, j], estimate.scores[:, j]))
        for kind, shared in (("proponents", proponents), ("opponents", opponents)):
            a = getattr(exact, kind)(int(target), TOP).example_id
            b = getattr(estimate, kind)(int(target), TOP).example_id
            shared.append(len(set(a) & set(b)) / TOP)
    return float(np.median(rhos)), float(np.mean(proponents)), float(np.mean(opponents))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["all", "cost", "digits"], default="all")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--targets", default="64,256", help="target counts for the cost")
    parser.add_argument("--cost-sketch-dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--digits-batch", type=int, default=32)
    parser.add_argument("--flip-fraction", type=float, default=0.15)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sketch-dims", default="4,8,16,32,64")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args(argv)
    print(load_average(), file=sys.stderr)
    tables = []
    with tempfile.TemporaryDirectory() as directory:
        if args.what in ("all", "cost"):
            tables.append(cost_table(args, Path(directory)))
        if args.what in ("all", "digits"):
            digits_args = argparse.Namespace(**{**vars(args), "batch_size": args.digits_batch})
            tables.append(digits_tables(digits_args, Path(directory)))
    report = "\n\n".join(tables) + f"\n\n({load_average()} at the end)\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()

"""How well does the gradient log find flipped labels? A rerunnable measurement.

Trains the demo's MLP on scikit-learn's digits with a fraction of the labels flipped
(ids 0..1796 passed in the input dict), logs with `HDF5GradientLogger`, and ranks the
examples from the log by

* TracIn self-influence: sum over logged steps of learning rate x squared gradient norm,
* how often the example's gradient has a negative cosine with the batch gradient,
* the example's mean loss over the logged steps (a baseline the log also holds).

For each ranking it prints the ROC AUC against the flipped labels and the precision and
recall among the top 10%, per seed and averaged, as a Markdown table.

    python benchmarks/mislabeled_digits.py                 # 3 seeds, 8 epochs, ~2 min
    python benchmarks/mislabeled_digits.py --seeds 0 --epochs 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from keras_gradtrack.analysis import DetectionMetrics, ExampleScores

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RANKINGS = ("self-influence", "negative-cosine frequency", "mean loss")
_FIELDS = ("roc_auc", "precision", "recall")


def measure(
    seed: int, epochs: int, flip_fraction: float, top_fraction: float, out: Path
) -> dict[str, DetectionMetrics]:
    """Trains one run; returns ranking name -> `DetectionMetrics`."""
    import keras

    import keras_gradtrack as kgt
    from keras_gradtrack import analysis, demo

    keras.utils.set_random_seed(seed)
    x, y, flipped = demo.load_digits_with_flipped_labels(flip_fraction, seed)
    path = out / f"digits_seed{seed}.h5"
    print(f"seed {seed}: training {epochs} epochs, logging to {path}", flush=True)
    demo.train(path, x, y, epochs, verbose=0)
    flipped_ids = np.flatnonzero(flipped)
    with kgt.GradientLog(path) as log:
        influence = log.self_influence()
        opposing = log.negative_cosine_frequency()
        mean_loss = mean_by_id(log.per_example("example_id"), log.per_example("loss"))
    scores = {
        "self-influence": influence,
        "negative-cosine frequency": opposing,
        "mean loss": mean_loss,
    }
    return {
        name: analysis.detection_metrics(score, flipped_ids, top_fraction)
        for name, score in scores.items()
    }


def mean_by_id(ids: np.ndarray, values: np.ndarray) -> ExampleScores:
    """The mean of a per-example column over each id's logged rows."""
    from keras_gradtrack import analysis

    distinct, inverse = np.unique(ids, return_inverse=True)
    rows = np.bincount(inverse)
    totals = np.bincount(inverse, weights=values.astype(np.float64))
    return analysis.ExampleScores("mean_loss", distinct, totals / rows, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--flip-fraction", type=float, default=0.1)
    parser.add_argument("--top-fraction", type=float, default=0.1)
    parser.add_argument("--out", help="directory for the logs (default: a temporary one)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch)
        out.mkdir(parents=True, exist_ok=True)
        runs = [
            measure(seed, args.epochs, args.flip_fraction, args.top_fraction, out)
            for seed in args.seeds
        ]
    top = f"top {args.top_fraction:.0%}"
    print(
        f"\ndigits (1797 examples), {args.flip_fraction:.0%} labels flipped, MLP 64-64-32-10, "
        f"Adam 3e-3, batch 64, {args.epochs} epochs, every step logged; seeds {args.seeds}\n"
    )
    rows = []
    for name in RANKINGS:
        for seed, run in zip(args.seeds, runs):
            metrics = run[name]
            rows.append((name, seed, *_figures(metrics.roc_auc, metrics.precision, metrics.recall)))
        if len(runs) > 1:
            means = [np.mean([getattr(run[name], f) for run in runs]) for f in _FIELDS]
            rows.append((f"**{name}**", "mean", *_figures(*means)))
    header = ("ranking", "seed", "ROC AUC", f"precision in {top}", f"recall in {top}")
    print(_markdown(header, rows))


def _figures(auc: float, precision: float, recall: float) -> tuple[str, str, str]:
    return f"{auc:.3f}", f"{precision:.0%}", f"{recall:.0%}"


def _markdown(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

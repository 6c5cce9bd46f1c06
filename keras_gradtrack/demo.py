"""`python -m keras_gradtrack.demo`: find flipped labels in scikit-learn's digits from the log.

A fraction of the training labels is flipped on purpose. The model is trained
with example ids and `HDF5GradientLogger`; the log is then read back with
`GradientLog`: its summary is printed, plots are written next to it, and the
examples are ranked by TracIn self-influence (the sum over logged steps of the
learning rate times the squared gradient norm). The top of that ranking is
mostly the flipped labels. With the `tensorboard` extra installed, the run is
also written for TensorBoard (`<out>/tensorboard/`: the gradient statistics'
scalars and histograms, and Keras' own loss curves with the step statistics
beside them), and the command that opens it is printed.

Example:

```
python -m keras_gradtrack.demo --out demo_output --epochs 8
keras-gradtrack top demo_output/digits_run.h5 -k 20
tensorboard --logdir demo_output/tensorboard
```
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

LOG_NAME = "digits_run.h5"
FLIPPED_NAME = "flipped_ids.txt"
TENSORBOARD_NAME = "tensorboard"


def load_digits_with_flipped_labels(
    flip_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Digits scaled to [0, 1], labels with `flip_fraction` changed, and the flipped mask.

    A flipped label is replaced by one of the 9 other classes, uniformly.

    Example:

    ```python
    x, y, flipped = load_digits_with_flipped_labels(0.1, seed=0)
    np.flatnonzero(flipped)  # the ids (row numbers) of the flipped labels
    ```
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    rng = np.random.default_rng(seed)
    flipped = rng.random(len(y)) < flip_fraction
    y = y.copy()
    y[flipped] = (y[flipped] + rng.integers(1, 10, flipped.sum())) % 10
    return x, y, flipped


def build_model() -> Any:
    """A small MLP (64-64-32-10) as a `GradientTrackingModel`, compiled with Adam.

    Example:

    ```python
    model = build_model()
    model.gradient_tracking_summary()
    ```
    """
    import keras

    import keras_gradtrack as kgt

    inputs = keras.Input((64,), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu", name="hidden_1")(inputs)
    hidden = keras.layers.Dense(32, activation="relu", name="hidden_2")(hidden)
    outputs = keras.layers.Dense(10, name="logits")(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs, name="digits_mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train(
    path: str | os.PathLike[str],
    x: np.ndarray,
    y: np.ndarray,
    epochs: int,
    verbose: int = 2,
    tensorboard_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Trains `build_model()` on `(x, y)` with ids `0..len(x)-1`, logging to `path`.

    The step statistics also go to fit's logs (the progress bar shows their epoch
    means). With `tensorboard_dir`, the run is written for TensorBoard too: the
    gradient statistics to `<tensorboard_dir>/gradients`, Keras' own logs (loss,
    accuracy and the step statistics) to `<tensorboard_dir>/keras`.

    Example:

    ```python
    train("run.h5", x, y, epochs=8, tensorboard_dir="tb")
    ```
    """
    import keras

    import keras_gradtrack as kgt

    model = build_model()
    if verbose:
        model.gradient_tracking_summary()
    callbacks = [kgt.HDF5GradientLogger(path, overwrite=True), kgt.GradientStatisticsToLogs()]
    if tensorboard_dir is not None:
        board = Path(tensorboard_dir)
        callbacks += [
            kgt.TensorBoardGradientLogger(board / "gradients"),
            # After GradientStatisticsToLogs: its logs hold the step statistics.
            keras.callbacks.TensorBoard(board / "keras", update_freq="batch", write_graph=False),
        ]
    model.fit(
        {"pixels": x, "example_id": np.arange(len(x))},
        y,
        batch_size=64,
        epochs=epochs,
        verbose=verbose,
        callbacks=callbacks,
    )
    return model


def report(path: str | os.PathLike[str], flipped: np.ndarray, top_fraction: float = 0.1) -> str:
    """What the log says about the flipped labels: detection figures and the top ids.

    Example:

    ```python
    print(report("demo_output/digits_run.h5", flipped))
    ```
    """
    import keras_gradtrack as kgt
    from keras_gradtrack import analysis

    flipped_ids = np.flatnonzero(flipped)
    with kgt.GradientLog(path) as log:
        influence = log.self_influence()
        by_influence = analysis.detection_metrics(influence, flipped_ids, top_fraction)
        by_cosine = analysis.detection_metrics(
            log.negative_cosine_frequency(), flipped_ids, top_fraction
        )
    top = influence.top(10)
    rows = [
        (rank, example_id, f"{score:.4g}", "flipped" if flipped[example_id] else "")
        for rank, (example_id, score) in enumerate(zip(top.example_id, top.score), start=1)
    ]
    share = f"{flipped.mean():.0%}"
    return "\n".join(
        [
            f"top {top_fraction:.0%} by self-influence ({by_influence.k} examples): "
            f"{by_influence.precision:.0%} have flipped labels (vs {share} of all examples); "
            f"they hold {by_influence.recall:.0%} of the flipped labels; "
            f"ROC AUC {by_influence.roc_auc:.3f}",
            f"(ranking by how often the cosine is negative does not find them: ROC AUC "
            f"{by_cosine.roc_auc:.3f}; flipped examples dominate the batch gradient)",
            "",
            "most influential examples:",
            analysis.text_table(rows, header=("rank", "example_id", "self_influence", "label")),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Trains, logs, writes the plots and prints the summary and the suspicious examples.

    Example:

    ```python
    main(["--out", "demo_output", "--epochs", "8"])
    ```
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_output", help="directory for the log and plots")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--flip-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true", help="skip writing the PNGs")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import keras

    import keras_gradtrack as kgt

    keras.utils.set_random_seed(args.seed)
    x, y, flipped = load_digits_with_flipped_labels(args.flip_fraction, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOG_NAME
    np.savetxt(out / FLIPPED_NAME, np.flatnonzero(flipped), fmt="%d")
    board = None
    if importlib.util.find_spec("tensorboard") is not None:
        board = out / TENSORBOARD_NAME
        # A rerun replaces the run, as it does the log (TensorBoard would show both).
        shutil.rmtree(board, ignore_errors=True)
    start = time.perf_counter()
    train(path, x, y, args.epochs, tensorboard_dir=board)
    print(f"trained {args.epochs} epochs in {time.perf_counter() - start:.1f} s; log: {path}")
    print(f"the ids of the {flipped.sum()} flipped labels: {out / FLIPPED_NAME}\n")
    with kgt.GradientLog(path) as log:
        print(log.summary(), end="\n\n")
        if not args.no_plots:
            print(_write_plots(log, out, flipped), end="\n\n")
    print(report(path, flipped))
    print(f"\nnext: keras-gradtrack top {path} -k 20   |   keras-gradtrack plot {path}")
    if board is None:
        print(
            'for TensorBoard: pip install "keras-gradtrack[tensorboard]", then run the demo again'
        )
    else:
        print(f"open the run in TensorBoard: tensorboard --logdir {board}")


def _write_plots(log: Any, out: Path, flipped: np.ndarray) -> str:
    from keras_gradtrack import plots

    try:
        written = plots.save_plots(
            log, out / "plots", highlight=np.flatnonzero(flipped), highlight_label="flipped label"
        )
    except ImportError as error:  # matplotlib is an optional extra
        return f"no plots: {error}"
    return "plots: " + ", ".join(str(path) for path in written)


if __name__ == "__main__":
    main()

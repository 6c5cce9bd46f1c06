"""Plots of a gradient log (matplotlib, `pip install keras-gradtrack[plots]`).

Every function returns a `matplotlib.figure.Figure` built without pyplot, so no
GUI backend and no global figure state are involved: save it with
`figure.savefig("x.png")`, or show it in a notebook by leaving it as a cell's value.

Example:

```python
import keras_gradtrack as kgt
from keras_gradtrack import plots

log = kgt.GradientLog("run.h5")
plots.plot_steps(log).savefig("steps.png")
plots.save_plots(log, "plots/")  # every plot as a PNG
```
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_gradtrack import analysis
from keras_gradtrack.analysis.scores import self_influence
from keras_gradtrack.analysis.tables import (
    grouped_rows,
    import_optional,
    layer_summary,
    per_example_column,
    per_layer_statistics,
)
from keras_gradtrack.io.schema import LEARNING_RATE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from keras_gradtrack.analysis.influence import Influence
    from keras_gradtrack.io.reader import LogReader

BAND = (0.1, 0.5, 0.9)
HIGHLIGHT_COLOR = "tab:red"
COLOR = "tab:blue"
MAX_HISTOGRAM_EPOCHS = 8


def plot_steps(log: LogReader) -> Figure:
    """Per-step gradient norms, cosines and diversity, with 10-90% bands over examples.

    Panels: per-example `grad_norm` (median and band) with `batch_grad_norm`;
    per-example `cosine` (median and band) with `frac_negative_cosine`;
    `gradient_diversity` with `noise_scale` on a second axis. Statistics the log
    does not hold are left out; dotted vertical lines mark epoch starts.

    Example:

    ```python
    plot_steps(log).savefig("steps.png", dpi=120)
    ```
    """
    figure = _figure(figsize=(9, 8))
    norm_axes, cosine_axes, diversity_axes = figure.subplots(3, 1, sharex=True)
    _band(norm_axes, log, "grad_norm", "per-example gradient norm")
    _step_line(norm_axes, log, "batch_grad_norm", "batch gradient norm", "black")
    norm_axes.set_yscale("log")
    norm_axes.set_title("How hard examples pull")
    _band(cosine_axes, log, "cosine", "per-example cosine with the batch gradient")
    _step_line(cosine_axes, log, "frac_negative_cosine", "fraction with cosine < 0", "tab:red")
    cosine_axes.axhline(0.0, color="grey", linewidth=0.8)
    cosine_axes.set_ylim(-1.05, 1.05)
    cosine_axes.set_title("Do examples agree with the step?")
    _step_line(diversity_axes, log, "gradient_diversity", "gradient diversity", "tab:green")
    if "noise_scale" in log.per_step_names:
        noise_axes = diversity_axes.twinx()
        _step_line(noise_axes, log, "noise_scale", "noise scale (right)", "tab:purple")
        noise_axes.set_yscale("log")
        noise_axes.set_ylabel("noise scale")
        _merge_legends(diversity_axes, noise_axes)
    diversity_axes.set_title("Gradient diversity and noise scale")
    diversity_axes.set_xlabel("step")
    for axes in (norm_axes, cosine_axes, diversity_axes):
        _mark_epochs(axes, log)
        if axes.get_legend_handles_labels()[0] and axes.get_legend() is None:
            axes.legend(loc="upper right", fontsize="small")
    return figure


def plot_layer_heatmap(
    log: LogReader, statistic: str = "layer_grad_norm", reduce: str = "median"
) -> Figure:
    """A per-layer statistic over steps: layers as rows, steps as columns.

    Norms use a logarithmic color scale; cosines a diverging one from -1 to 1.

    Args:
        log: the log.
        statistic: a per-layer statistic (`layer_grad_norm`, `layer_cosine`, ...).
        reduce: how the examples of a step are combined (`GradientLog.layer_summary`).

    Example:

    ```python
    plot_layer_heatmap(log, "layer_cosine").savefig("layer_cosine.png")
    ```
    """
    colors = import_optional("matplotlib.colors", "keras_gradtrack.plots", "plots")
    summary = layer_summary(log, statistic, by="step", reduce=reduce)
    _require_rows(log)
    figure = _figure(figsize=(9, 1.5 + 0.4 * len(summary.layers)))
    axes = figure.subplots()
    values = np.ma.masked_invalid(summary.values.T)
    options: dict[str, Any] = {"cmap": "viridis"}
    if "cosine" in statistic:
        options = {"cmap": "RdBu", "vmin": -1.0, "vmax": 1.0}
    elif values.count() and values.min() > 0:
        options["norm"] = colors.LogNorm(vmin=values.min(), vmax=values.max())
    image = axes.pcolormesh(
        _edges(summary.index), np.arange(len(summary.layers) + 1), values, **options
    )
    axes.set_yticks(np.arange(len(summary.layers)) + 0.5, summary.layers)
    axes.invert_yaxis()
    axes.set_xlabel("step")
    axes.set_title(f"{reduce} {statistic} over the examples of each step")
    colorbar = figure.colorbar(image, ax=axes, label=statistic)
    if "norm" in options:  # ticks 0.5, 1, 2, 5, ... written plainly, not as 5x10^-1
        ticker = import_optional("matplotlib.ticker", "keras_gradtrack.plots", "plots")
        colorbar.ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        colorbar.ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        colorbar.ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    return figure


def plot_cosine_histogram(log: LogReader, bins: int = 50) -> Figure:
    """Histogram of the per-example cosines, one outline per epoch (at most 8 shown).

    Example:

    ```python
    plot_cosine_histogram(log).savefig("cosine_histogram.png")
    ```
    """
    cm = import_optional("matplotlib.cm", "keras_gradtrack.plots", "plots")
    cosine = per_example_column(log, "cosine").astype(np.float64)
    epochs, groups = grouped_rows(log.per_example("epoch"))
    shown = np.unique(np.linspace(0, len(epochs) - 1, min(len(epochs), MAX_HISTOGRAM_EPOCHS)))
    figure = _figure(figsize=(7, 4))
    axes = figure.subplots()
    edges = np.linspace(-1.0, 1.0, bins + 1).tolist()
    for position, index in enumerate(shown.astype(int)):
        values = cosine[groups[index]]
        values = values[np.isfinite(values)]
        color = cm.viridis(0.85 * position / max(len(shown) - 1, 1))
        negative = np.mean(values < 0) if values.size else float("nan")
        label = f"epoch {epochs[index]} ({negative:.0%} < 0)"
        axes.hist(values, bins=edges, histtype="step", density=True, color=color, label=label)
    axes.axvline(0.0, color="grey", linewidth=0.8)
    axes.set_xlim(-1, 1)
    axes.set_xlabel("cosine of the example's gradient with the batch gradient")
    axes.set_ylabel("density")
    axes.set_title("Per-example cosine, by epoch")
    if len(shown):
        axes.legend(fontsize="small")
    return figure


def plot_self_influence(
    log: LogReader,
    k: int = 20,
    highlight: Iterable[int] | None = None,
    learning_rate: float | None = None,
    highlight_label: str = "highlighted",
) -> Figure:
    """Examples ranked by TracIn self-influence; the top `k` by id.

    Left: every example's self-influence, sorted (log scale). Right: the `k` highest
    with their ids. Ids in `highlight` (e.g. known flipped labels) are drawn in red.

    Args:
        log: the log (needs `grad_norm` and, unless `learning_rate` is given,
            `/per_step/learning_rate`).
        k: how many examples the right panel names.
        highlight: ids to mark.
        learning_rate: a constant rate instead of the logged one.
        highlight_label: what the marked ids are, for the legend.

    Example:

    ```python
    plot_self_influence(log, k=20, highlight=np.flatnonzero(flipped)).savefig("top.png")
    ```
    """
    scores = self_influence(log, learning_rate)
    marked = np.isin(
        scores.example_id, np.fromiter(() if highlight is None else highlight, dtype=np.int64)
    )
    ranked = scores.top(max(len(scores), 1)) if len(scores) else scores
    ranked_marked = np.isin(ranked.example_id, scores.example_id[marked])
    figure = _figure(figsize=(10, 4.5))
    curve_axes, top_axes = figure.subplots(1, 2, width_ratios=(3, 2))
    ranks = np.arange(1, len(ranked) + 1)
    curve_axes.plot(ranks, ranked.score, color=COLOR, linewidth=1, label="all examples")
    if highlight is not None:
        curve_axes.scatter(
            ranks[ranked_marked],
            ranked.score[ranked_marked],
            s=8,
            color=HIGHLIGHT_COLOR,
            label=f"{highlight_label} ({int(marked.sum())})",
            zorder=3,
        )
    if len(ranked):
        curve_axes.axvline(max(1, len(ranked) // 10), color="grey", linestyle=":", label="top 10%")
    if len(ranked) and (ranked.score > 0).all():
        curve_axes.set_yscale("log")
    curve_axes.set_xlabel("rank")
    curve_axes.set_ylabel("self-influence  (sum over steps of lr x ||g||²)")
    curve_axes.set_title("Examples by self-influence")
    curve_axes.legend(fontsize="small")
    top = ranked.top(k) if len(ranked) else ranked
    top_marked = ranked_marked[: len(top)]
    positions = np.arange(len(top))
    top_axes.barh(positions, top.score, color=np.where(top_marked, HIGHLIGHT_COLOR, COLOR))
    top_axes.set_yticks(positions, [str(i) for i in top.example_id], fontsize="small")
    top_axes.invert_yaxis()
    top_axes.set_xlabel("self-influence")
    top_axes.set_title(f"Top {len(top)} example ids")
    return figure


def plot_proponents_and_opponents(
    influence: Influence,
    target_ids: Iterable[int],
    images: Any,
    labels: Any,
    target_images: Any,
    target_labels: Any = None,
    predicted: Any = None,
    k: int = 5,
    highlight: Iterable[int] | None = None,
    highlight_label: str = "highlighted",
    image_shape: tuple[int, ...] | None = None,
) -> Figure:
    """Each target's image beside the training images that pushed toward it and away.

    One row per target: the target (its label and the model's prediction), its `k`
    proponents (highest TracIn influence, green titles) and `k` opponents (most
    negative, red titles), each with its id, the label it was trained with and its
    score. Ids in `highlight` (e.g. known flipped labels) are marked with `*`.

    Args:
        influence: from `GradientLog.influence()`.
        target_ids: the targets to show.
        images: training images indexed by training id (`images[id]`).
        labels: the labels the training examples were trained with, by id.
        target_images: the targets' images, indexed by target id.
        target_labels: the targets' true labels, by target id (optional).
        predicted: the model's predicted labels, by target id (optional).
        k: proponents and opponents shown per target.
        highlight: training ids to mark; `highlight_label` says what they are.
        image_shape: the shape to draw each image with; default: as stored (a flat
            image of square size as a square).

    Example:

    ```python
    plot_proponents_and_opponents(log.influence(), wrong[:4], x, y, x_test, y_test, predicted)
    ```
    """
    shown = [int(t) for t in target_ids]
    marked = set(() if highlight is None else (int(i) for i in highlight))
    figure = _figure(figsize=(1.3 * (2 * k + 1), 1.6 * max(len(shown), 1)))
    grid = figure.subplots(max(len(shown), 1), 2 * k + 1, squeeze=False)
    for row, target in zip(grid, shown):
        title = f"target {target}"
        if target_labels is not None:
            title += f"\nlabel {target_labels[target]}"
        if predicted is not None:
            title += f", pred {predicted[target]}"
        _image(row[0], target_images[target], image_shape, title, "black")
        sides = (
            (influence.proponents(target, k), "tab:green"),
            (influence.opponents(target, k), "tab:red"),
        )
        for offset, (scores, color) in enumerate(sides):
            for position, (example_id, score) in enumerate(zip(scores.example_id, scores.score)):
                star = "*" if int(example_id) in marked else ""
                title = f"{example_id}{star}: {labels[example_id]}\n{score:+.2g}"
                _image(
                    row[1 + offset * k + position], images[example_id], image_shape, title, color
                )
    for axes in grid.ravel():
        axes.set_axis_off()
    legend = f"   (* {highlight_label})" if marked else ""
    figure.suptitle(f"target | {k} proponents | {k} opponents{legend}", fontsize="medium")
    return figure


def save_plots(
    log: LogReader,
    out_dir: str | os.PathLike[str],
    highlight: Iterable[int] | None = None,
    highlight_label: str = "highlighted",
    dpi: int = 110,
) -> list[Path]:
    """Writes every plot the log's statistics allow as a PNG into `out_dir`.

    Files: `steps.png`, `layer_grad_norm.png`, `layer_cosine.png`,
    `cosine_histogram.png`, `self_influence.png` (each only if the log holds what it
    needs). The directory is created if missing. `highlight` and `highlight_label`
    go to `plot_self_influence`.

    Returns:
        The paths written.

    Example:

    ```python
    for path in save_plots(log, "plots"):
        print(path)
    ```
    """
    _require_rows(log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_example = set(log.per_example_names)
    per_layer = per_layer_statistics(log)
    builders: dict[str, Any] = {"steps": lambda: plot_steps(log)}
    for statistic in ("layer_grad_norm", "layer_cosine"):
        if statistic in per_layer:
            builders[statistic] = lambda name=statistic: plot_layer_heatmap(log, name)
    if "cosine" in per_example:
        builders["cosine_histogram"] = lambda: plot_cosine_histogram(log)
    learning_rate_known = LEARNING_RATE in log.per_step_names
    if "grad_norm" in per_example and learning_rate_known:
        builders["self_influence"] = lambda: plot_self_influence(
            log, highlight=highlight, highlight_label=highlight_label
        )
    written = []
    for name, build in builders.items():
        path = out / f"{name}.png"
        build().savefig(path, dpi=dpi)
        written.append(path)
    return written


def _figure(figsize: tuple[float, float]) -> Figure:
    figure_module = import_optional("matplotlib.figure", "keras_gradtrack.plots", "plots")
    return figure_module.Figure(figsize=figsize, layout="constrained")


def _image(axes: Any, image: Any, shape: tuple[int, ...] | None, title: str, color: str) -> None:
    image = np.asarray(image, np.float64)
    if shape is not None:
        image = image.reshape(shape)
    elif image.ndim == 1 and int(np.sqrt(image.size)) ** 2 == image.size:
        side = int(np.sqrt(image.size))
        image = image.reshape(side, side)
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    axes.imshow(image, cmap="gray_r" if image.ndim == 2 else None)
    axes.set_title(title, fontsize="x-small", color=color)


def _require_rows(log: LogReader) -> None:
    if log.num_steps == 0:
        raise ValueError(f"'{log.path}' has no tracked steps yet: nothing to plot.")


def _band(axes: Any, log: LogReader, statistic: str, label: str) -> None:
    if statistic not in log.per_example_names:
        return
    steps, bands = analysis.step_quantiles(log, statistic, BAND)
    axes.fill_between(steps, bands[:, 0], bands[:, 2], color=COLOR, alpha=0.25, linewidth=0)
    axes.plot(steps, bands[:, 1], color=COLOR, label=f"{label} (median, 10-90%)")


def _step_line(axes: Any, log: LogReader, statistic: str, label: str, color: str) -> None:
    if statistic in log.per_step_names:
        axes.plot(log.per_step("step"), log.per_step(statistic), color=color, label=label)


def _mark_epochs(axes: Any, log: LogReader) -> None:
    steps, epochs = log.per_step("step"), log.per_step("epoch")
    for step in steps[1:][np.diff(epochs) != 0]:
        axes.axvline(step, color="grey", linestyle=":", linewidth=0.8)


def _merge_legends(left: Any, right: Any) -> None:
    handles, labels = left.get_legend_handles_labels()
    more_handles, more_labels = right.get_legend_handles_labels()
    left.legend(handles + more_handles, labels + more_labels, loc="upper right", fontsize="small")


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around sorted step numbers, for `pcolormesh`."""
    centers = centers.astype(np.float64)
    if len(centers) == 1:
        return np.array([centers[0] - 0.5, centers[0] + 0.5])
    middles = (centers[1:] + centers[:-1]) / 2
    return np.concatenate([[2 * centers[0] - middles[0]], middles, [2 * centers[-1] - middles[-1]]])

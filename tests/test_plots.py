"""Tests of keras_gradtrack.plots: each function draws what the log holds, as a Figure."""

import sys
from pathlib import Path

import numpy as np
import pytest
from test_analysis import ATTRS, LAYERS, SUSPICIOUS, write_log

from keras_gradtrack import analysis
from keras_gradtrack.analysis import GradientLog
from keras_gradtrack.io import LogWriter

pytest.importorskip("matplotlib")
from matplotlib.colors import LogNorm, to_hex
from matplotlib.figure import Figure

from keras_gradtrack import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def log(tmp_path: Path):
    written = write_log(tmp_path / "run.h5", epochs=10, num_examples=24, batch_size=8)
    with GradientLog(written.path) as opened:
        yield opened


def test_plot_steps_draws_bands_and_per_step_lines(log):
    figure = plots.plot_steps(log)
    assert isinstance(figure, Figure)
    norm_axes, cosine_axes, _, noise_axes = figure.axes
    steps, bands = analysis.step_quantiles(log, "grad_norm")
    median_line = norm_axes.get_lines()[0]
    np.testing.assert_allclose(median_line.get_xdata(), steps)
    np.testing.assert_allclose(median_line.get_ydata(), bands[:, 1])
    assert len(norm_axes.collections) == 1  # the 10-90% band
    labels = [line.get_label() for axes in figure.axes for line in axes.get_lines()]
    for expected in ("batch gradient norm", "fraction with cosine < 0", "gradient diversity"):
        assert expected in labels
    assert noise_axes.get_yscale() == "log"
    epoch_marks = [line for line in cosine_axes.get_lines() if line.get_linestyle() == ":"]
    assert len(epoch_marks) == 9  # 10 epochs


@pytest.mark.parametrize("statistic", ["layer_grad_norm", "layer_cosine"])
def test_plot_layer_heatmap_shows_the_layer_summary(log, statistic):
    figure = plots.plot_layer_heatmap(log, statistic)
    axes = figure.axes[0]
    mesh = axes.collections[0]
    summary = log.layer_summary(statistic)
    np.testing.assert_allclose(
        np.asarray(mesh.get_array()).reshape(len(LAYERS), -1), summary.values.T
    )
    assert [label.get_text() for label in axes.get_yticklabels()] == LAYERS
    if statistic == "layer_cosine":
        assert (mesh.norm.vmin, mesh.norm.vmax) == (-1.0, 1.0)
    else:
        assert isinstance(mesh.norm, LogNorm)


def test_plot_cosine_histogram_shows_at_most_eight_epochs(log):
    axes = plots.plot_cosine_histogram(log, bins=20).axes[0]
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert (
        len(labels) == 8 and labels[0].startswith("epoch 0 (") and labels[-1].startswith("epoch 9")
    )
    assert axes.get_xlim() == (-1.0, 1.0)


def test_plot_self_influence_marks_highlighted_ids(log):
    figure = plots.plot_self_influence(
        log, k=5, highlight=[SUSPICIOUS[0]], highlight_label="flipped"
    )
    curve_axes, top_axes = figure.axes
    top = log.most_influential(5)
    assert [label.get_text() for label in top_axes.get_yticklabels()] == [
        str(i) for i in top.example_id
    ]
    colors = [to_hex(bar.get_facecolor()) for bar in top_axes.patches]
    expected = [
        to_hex(plots.HIGHLIGHT_COLOR if i == SUSPICIOUS[0] else plots.COLOR) for i in top.example_id
    ]
    assert colors == expected
    assert "flipped (1)" in [text.get_text() for text in curve_axes.get_legend().get_texts()]
    np.testing.assert_allclose(
        curve_axes.get_lines()[0].get_ydata(), log.most_influential(24).score
    )


def test_save_plots_writes_every_png(log, tmp_path):
    written = plots.save_plots(log, tmp_path / "plots", highlight=SUSPICIOUS, dpi=40)
    names = ["steps", "layer_grad_norm", "layer_cosine", "cosine_histogram", "self_influence"]
    assert written == [tmp_path / "plots" / f"{name}.png" for name in names]
    for path in written:
        assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_save_plots_leaves_out_what_the_log_lacks(tmp_path):
    path = tmp_path / "small.h5"
    with LogWriter(
        path, layer_names=LAYERS, per_example={"grad_norm": None}, per_step={}, attrs=ATTRS
    ) as writer:
        writer.write_step(
            step=0,
            epoch=0,
            example_ids=np.arange(4),
            per_example={"grad_norm": np.ones(4)},
            per_step={},
        )
    with GradientLog(path) as log:
        assert [p.name for p in plots.save_plots(log, tmp_path / "out")] == ["steps.png"]


def test_empty_log_has_nothing_to_plot(tmp_path):
    path = tmp_path / "empty.h5"
    with LogWriter(path, layer_names=LAYERS, per_example={}, per_step={}, attrs=ATTRS):
        pass
    with GradientLog(path) as log, pytest.raises(ValueError, match="no tracked steps yet"):
        plots.save_plots(log, tmp_path / "out")


def test_without_matplotlib_the_error_says_how_to_install(log, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install keras-gradtrack\[plots\]"):
        plots.plot_steps(log)

"""Tests of keras_gradtrack.analysis (and the GradientLog methods delegating to it).

Every analysis is checked against a plain Python loop over the rows written.
`write_log` is also used by the plot and CLI tests.
"""

import dataclasses
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from keras_gradtrack import analysis
from keras_gradtrack.analysis import GradientLog
from keras_gradtrack.io import LogWriter

LAYERS = ["hidden", "logits"]
PER_EXAMPLE = {
    "loss": None,
    "grad_norm": None,
    "cosine": None,
    "layer_grad_norm": len(LAYERS),
    "layer_cosine": len(LAYERS),
}
PER_STEP = {
    "batch_grad_norm": None,
    "gradient_diversity": None,
    "noise_scale": None,
    "mean_cosine": None,
    "frac_negative_cosine": None,
    "learning_rate": None,
}
ATTRS = {
    "library_version": "0.1.0",
    "keras_version": "3.0.0",
    "tensorflow_version": "2.16.0",
    "model_name": "synthetic",
}
SUSPICIOUS = (3, 17, 29)


@dataclasses.dataclass
class WrittenLog:
    """A synthetic log and the rows written to it, for loop-based expectations."""

    path: Path
    rows: list[dict]  # one dict per per-example row
    learning_rates: dict[int, float]  # step -> rate

    def expected(self, value) -> dict[int, list]:
        """id -> [value(row) for each of its rows]."""
        by_id: dict[int, list] = {}
        for row in self.rows:
            by_id.setdefault(row["example_id"], []).append(value(row))
        return by_id


def write_log(
    path: Path,
    *,
    num_examples: int = 40,
    epochs: int = 3,
    batch_size: int = 16,
    learning_rate: bool = True,
    seed: int = 0,
) -> WrittenLog:
    """Writes a log shaped like HDF5GradientLogger's: shuffled ids, ragged last batch.

    The `SUSPICIOUS` ids get large gradient norms; the learning rate decays per step.
    """
    rng = np.random.default_rng(seed)
    per_step = (
        dict(PER_STEP) if learning_rate else {k: None for k in PER_STEP if k != "learning_rate"}
    )
    writer = LogWriter(
        path,
        layer_names=LAYERS,
        per_example=PER_EXAMPLE,
        per_step=per_step,
        attrs=ATTRS,
        flush_every=3,
    )
    rows, rates = [], {}
    step = -1
    with writer:
        for epoch in range(epochs):
            order = rng.permutation(num_examples)
            for start in range(0, num_examples, batch_size):
                ids = order[start : start + batch_size]
                step += 1  # a new file: the writer's steps are the file's
                rates[step] = 0.1 / (1 + step)
                layer_norms = rng.uniform(0.1, 1.0, (len(ids), len(LAYERS)))
                layer_norms[np.isin(ids, SUSPICIOUS)] *= 10
                statistics = {
                    "loss": rng.uniform(0, 2, len(ids)),
                    "grad_norm": np.sqrt((layer_norms**2).sum(axis=1)),
                    "cosine": rng.uniform(-1, 1, len(ids)),
                    "layer_grad_norm": layer_norms,
                    "layer_cosine": rng.uniform(-1, 1, (len(ids), len(LAYERS))),
                }
                statistics["cosine"][0] = np.nan if step == 1 else statistics["cosine"][0]
                step_values = {name: float(rng.uniform(0.1, 1)) for name in per_step}
                step_values.pop("learning_rate", None)
                if learning_rate:
                    step_values["learning_rate"] = rates[step]
                writer.write_step(
                    step=step,
                    epoch=epoch,
                    example_ids=ids,
                    per_example=statistics,
                    per_step=step_values,
                )
                for position, example_id in enumerate(ids):
                    row = {"step": step, "epoch": epoch, "example_id": int(example_id)}
                    row.update({k: np.float32(v[position]) for k, v in statistics.items()})
                    rows.append(row)
    return WrittenLog(path, rows, rates)


@pytest.fixture
def written(tmp_path: Path) -> WrittenLog:
    return write_log(tmp_path / "run.h5")


@pytest.fixture
def log(written: WrittenLog):
    with GradientLog(written.path) as opened:
        yield opened


def as_dict(scores: analysis.ExampleScores) -> dict[int, float]:
    return dict(zip(scores.example_id.tolist(), scores.score.tolist()))


def test_self_influence_sums_learning_rate_times_squared_norm(written, log):
    expected = written.expected(
        lambda row: written.learning_rates[row["step"]] * float(row["grad_norm"]) ** 2
    )
    scores = log.self_influence()
    assert scores.name == "self_influence"
    assert scores.example_id.tolist() == sorted(expected)
    np.testing.assert_allclose(
        scores.score, [sum(expected[i]) for i in sorted(expected)], rtol=1e-6
    )
    assert scores.rows.tolist() == [len(expected[i]) for i in sorted(expected)]


def test_self_influence_with_a_constant_learning_rate(tmp_path):
    written = write_log(tmp_path / "no_lr.h5", learning_rate=False)
    expected = written.expected(lambda row: float(row["grad_norm"]) ** 2)
    with GradientLog(written.path) as log:
        with pytest.raises(KeyError, match="learning_rate"):
            log.self_influence()
        scores = log.self_influence(learning_rate=1.0)
    np.testing.assert_allclose(
        scores.score, [sum(expected[i]) for i in sorted(expected)], rtol=1e-6
    )


def test_rows_of_a_step_without_its_per_step_row_are_left_out(written):
    with h5py.File(written.path, "a") as file:
        for dataset in file["per_step"].values():
            dataset.resize(dataset.shape[0] - 1, axis=0)  # the last step's row is "not yet written"
    last_step = max(written.learning_rates)
    with GradientLog(written.path) as log:
        rates = analysis.per_example_learning_rate(log)
        steps = log.per_example("step")
        assert np.isnan(rates[steps == last_step]).all()
        np.testing.assert_allclose(
            rates[steps != last_step],
            [written.learning_rates[s] for s in steps[steps != last_step]],
        )
        scores = log.self_influence()
    kept = [row for row in written.rows if row["step"] != last_step]
    assert scores.rows.sum() == len(kept)


def test_most_influential_finds_the_large_gradients(log):
    top = log.most_influential(len(SUSPICIOUS))
    assert sorted(top.example_id.tolist()) == sorted(SUSPICIOUS)
    assert np.all(np.diff(top.score) <= 0)
    assert len(log.most_influential(5)) == 5


def test_top_orders_by_score_then_id_with_nan_last():
    scores = analysis.ExampleScores(
        "s", np.array([5, 1, 2, 3, 4]), np.array([1.0, np.nan, 2.0, 1.0, 3.0]), np.ones(5, int)
    )
    assert scores.top(5).example_id.tolist() == [4, 2, 3, 5, 1]
    assert scores.top(10).example_id.tolist() == [4, 2, 3, 5, 1]
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="Received: k="):
            scores.top(k)


def test_negative_cosine_frequency_counts_nan_as_not_negative(written, log):
    expected = written.expected(lambda row: bool(row["cosine"] < 0))
    scores = log.negative_cosine_frequency()
    assert scores.name == "frac_negative_cosine"
    assert as_dict(scores) == pytest.approx({i: np.mean(v) for i, v in expected.items()})
    top = log.most_opposing(4)
    assert top.score.tolist() == sorted(scores.score, reverse=True)[:4]


def test_example_history_is_in_step_order(written, log):
    history = log.example_history(SUSPICIOUS[0])
    rows = [row for row in written.rows if row["example_id"] == SUSPICIOUS[0]]
    assert history["step"].tolist() == [row["step"] for row in rows]
    for name in PER_EXAMPLE:
        np.testing.assert_array_equal(history[name], np.stack([row[name] for row in rows]))
    assert history["layer_grad_norm"].shape == (len(rows), len(LAYERS))
    np.testing.assert_allclose(
        history["learning_rate"], [written.learning_rates[row["step"]] for row in rows]
    )
    with pytest.raises(KeyError, match=r"example_id=999 is not in .* ids 0\.\.39"):
        log.example_history(999)


@pytest.mark.parametrize("by", ["step", "epoch"])
@pytest.mark.parametrize("reduce", ["median", "mean", "max"])
def test_layer_summary_reduces_each_step_or_epoch(written, log, by, reduce):
    summary = log.layer_summary("layer_grad_norm", by=by, reduce=reduce)
    groups = sorted({row[by] for row in written.rows})
    assert summary.index.tolist() == groups
    assert summary.layers == LAYERS
    for position, key in enumerate(groups):
        block = np.stack([row["layer_grad_norm"] for row in written.rows if row[by] == key])
        expected = getattr(np, reduce)(block.astype(np.float64), axis=0)
        np.testing.assert_allclose(summary.values[position], expected, rtol=1e-6)


def test_layer_summary_rejects_what_is_not_per_layer(log):
    with pytest.raises(ValueError, match=r"one of \['layer_grad_norm', 'layer_cosine'\]"):
        log.layer_summary("cosine")
    with pytest.raises(ValueError, match="Received: by='batch'"):
        log.layer_summary(by="batch")
    with pytest.raises(ValueError, match="Received: reduce='sum'"):
        log.layer_summary(reduce="sum")


def test_step_quantiles_ignore_nan(written, log):
    steps, bands = analysis.step_quantiles(log, "cosine", (0.1, 0.5, 0.9))
    assert steps.tolist() == sorted(written.learning_rates)
    for position, step in enumerate(steps):
        values = np.array([row["cosine"] for row in written.rows if row["step"] == step], float)
        np.testing.assert_allclose(bands[position], np.nanquantile(values, [0.1, 0.5, 0.9]))
    with pytest.raises(ValueError, match="one value per row"):
        analysis.step_quantiles(log, "layer_cosine")
    with pytest.raises(KeyError, match="'accuracy'"):
        analysis.step_quantiles(log, "accuracy")


def test_detection_metrics_match_pairwise_counting():
    rng = np.random.default_rng(0)
    score = rng.integers(0, 6, 50).astype(float)  # many ties
    score[7] = np.nan
    scores = analysis.ExampleScores("s", np.arange(100, 150), score, np.ones(50, int))
    positive_ids = [100, 103, 107, 120, 121, 149]
    metrics = analysis.detection_metrics(scores, positive_ids, top_fraction=0.2)
    values = np.where(np.isnan(score), -np.inf, score)
    positive = np.isin(scores.example_id, positive_ids)
    pairs = [
        1.0 if p > n else 0.5 if p == n else 0.0
        for p in values[positive]
        for n in values[~positive]
    ]
    assert metrics.roc_auc == pytest.approx(np.mean(pairs))
    hits = np.isin(scores.top(10).example_id, positive_ids).sum()
    assert (metrics.k, metrics.positives, metrics.examples) == (10, 6, 50)
    assert metrics.precision == hits / 10 and metrics.recall == hits / 6
    assert "ROC AUC" in str(metrics)
    assert np.isnan(analysis.detection_metrics(scores, []).roc_auc)
    with pytest.raises(ValueError, match="top_fraction"):
        analysis.detection_metrics(scores, positive_ids, top_fraction=0)


def test_csv_and_parquet_hold_the_pandas_frame(log, tmp_path, monkeypatch):
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    monkeypatch.setattr(analysis.tables, "CSV_BLOCK_ROWS", 7)  # several blocks
    for kind in ("per_example", "per_step"):
        frame = log.to_pandas(kind)
        from_csv = pandas.read_csv(log.to_csv(tmp_path / f"{kind}.csv", kind=kind))
        assert list(from_csv.columns) == list(frame.columns)
        np.testing.assert_allclose(from_csv.to_numpy(float), frame.to_numpy(float), rtol=1e-6)
        from_parquet = pandas.read_parquet(log.to_parquet(tmp_path / f"{kind}.parquet", kind=kind))
        pandas.testing.assert_frame_equal(from_parquet, frame)
    assert "layer_grad_norm/logits" in frame.columns or kind == "per_step"
    with pytest.raises(ValueError, match="Received: kind='rows'"):
        log.to_csv(tmp_path / "x.csv", kind="rows")


def test_parquet_without_pyarrow_says_how_to_install(log, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install keras-gradtrack\[parquet\]"):
        log.to_parquet(tmp_path / "x.parquet")


def test_example_scores_to_pandas(log):
    pytest.importorskip("pandas")
    frame = log.most_influential(3).to_pandas()
    assert list(frame.columns) == ["example_id", "self_influence", "rows"]
    assert len(frame) == 3


def test_summary_lists_counts_layers_and_every_statistic(written, log):
    text = log.summary()
    assert f"{len(written.rows)} rows, 40 distinct ids" in text
    assert f"{len(written.learning_rates)} tracked" in text
    assert "hidden, logits" in text and "synthetic" in text
    for name in (*PER_EXAMPLE, *PER_STEP):
        assert f"\n{name} " in text
    assert "per layer, epoch 2:" in text


def test_summary_of_an_empty_log(tmp_path):
    with LogWriter(
        tmp_path / "empty.h5",
        layer_names=LAYERS,
        per_example=PER_EXAMPLE,
        per_step=PER_STEP,
        attrs=ATTRS,
    ):
        pass
    with GradientLog(tmp_path / "empty.h5") as log:
        text = log.summary()
        assert "0 tracked" in text and "0 rows, 0 distinct ids" in text
        assert len(log.self_influence()) == 0


def test_text_table_aligns_columns():
    table = analysis.text_table([(1, "a"), (22, "bbb")], header=("id", "name"))
    assert table.splitlines() == ["id  name", "--  ----", "1   a", "22  bbb"]

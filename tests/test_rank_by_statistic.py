"""Ranking examples by the mean of any logged per-example statistic: `GradientLog.rank_by`
and `keras-gradtrack top --by loss`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_analysis import WrittenLog, write_log

from keras_gradtrack import cli
from keras_gradtrack.analysis import GradientLog


@pytest.fixture
def written(tmp_path: Path) -> WrittenLog:
    return write_log(tmp_path / "run.h5")


def loop_means(written: WrittenLog, statistic: str) -> dict[int, float]:
    """id -> the mean of its non-NaN rows, by a plain loop."""
    means = {}
    for example_id, values in written.expected(lambda row: row[statistic]).items():
        kept = [float(v) for v in values if not np.isnan(v)]
        means[example_id] = sum(kept) / len(kept) if kept else float("nan")
    return means


@pytest.mark.parametrize("statistic", ["loss", "grad_norm", "cosine"])
def test_mean_by_example_is_the_mean_of_each_ids_rows(written: WrittenLog, statistic: str) -> None:
    expected = loop_means(written, statistic)
    with GradientLog(written.path) as log:
        scores = log.mean_by_example(statistic)
    assert scores.name == f"mean_{statistic}"
    assert scores.example_id.tolist() == sorted(expected)
    np.testing.assert_allclose(scores.score, [expected[i] for i in sorted(expected)], rtol=1e-6)


@pytest.mark.parametrize(
    ("statistic", "high_first"), [("loss", True), ("grad_norm", True), ("cosine", False)]
)
def test_rank_by_puts_high_loss_and_low_cosine_first_and_reverse_turns_it(
    written: WrittenLog, statistic: str, high_first: bool
) -> None:
    expected = loop_means(written, statistic)
    order = sorted(expected, key=lambda i: (-expected[i] if high_first else expected[i], i))
    with GradientLog(written.path) as log:
        ranked = log.rank_by(statistic, k=5)
        reversed_ranking = log.rank_by(statistic, k=5, reverse=True)
    assert ranked.example_id.tolist() == order[:5]
    assert reversed_ranking.example_id.tolist() == order[::-1][:5]


def test_rank_by_grad_norm_finds_the_suspicious_examples(written: WrittenLog) -> None:
    from test_analysis import SUSPICIOUS

    with GradientLog(written.path) as log:
        assert sorted(log.rank_by("grad_norm", k=3).example_id) == sorted(SUSPICIOUS)


@pytest.mark.parametrize("statistic", ["los", "layer_grad_norm", "example_id"])
def test_an_unknown_statistic_is_refused_listing_the_available_ones(
    written: WrittenLog, statistic: str
) -> None:
    with (
        GradientLog(written.path) as log,
        pytest.raises(ValueError, match=r"Available: \['loss', 'grad_norm', 'cosine'\]"),
    ):
        log.rank_by(statistic)


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_top_by_a_statistic_prints_the_ranking(capsys, written: WrittenLog) -> None:
    with GradientLog(written.path) as log:
        expected = log.rank_by("loss", k=4)
        expected_low = log.rank_by("loss", k=4, reverse=True)
    status, out, _ = run(capsys, "top", written.path, "-k", "4", "--by", "loss")
    lines = out.strip().splitlines()
    assert status == 0 and lines[0].split() == ["rank", "example_id", "mean_loss", "rows"]
    assert [int(line.split()[1]) for line in lines[2:]] == expected.example_id.tolist()
    status, out, _ = run(capsys, "top", written.path, "-k", "4", "--by", "loss", "--reverse")
    ids = [int(line.split()[1]) for line in out.strip().splitlines()[2:]]
    assert status == 0 and ids == expected_low.example_id.tolist()


def test_top_reverse_turns_the_built_in_rankings_around(capsys, written: WrittenLog) -> None:
    with GradientLog(written.path) as log:
        expected = log.self_influence().bottom(3).example_id.tolist()
    status, out, _ = run(capsys, "top", written.path, "-k", "3", "--reverse")
    assert status == 0 and [int(line.split()[1]) for line in out.strip().splitlines()[2:]] == (
        expected
    )


def test_top_by_an_unknown_name_is_one_line_listing_what_is_available(
    capsys, written: WrittenLog
) -> None:
    status, out, err = run(capsys, "top", written.path, "--by", "los")
    assert status == 1 and out == ""
    assert err.strip() == (
        f"keras-gradtrack: error: Cannot rank by 'los': it is neither a ranking nor a "
        f"per-example statistic of '{written.path}'. Did you mean 'loss'? Available: "
        "self-influence, negative-cosine, loss, grad_norm, cosine"
    )

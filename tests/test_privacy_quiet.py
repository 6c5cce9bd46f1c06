"""dp-accounting's warnings about Rényi orders it leaves out are silenced around the
library's own calls only."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("dp_accounting")

from keras_gradtrack import privacy
from keras_gradtrack.privacy import accounting


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def absl_records():  # type: ignore[no-untyped-def]
    logger, handler = logging.getLogger("absl"), Records()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_epsilon_and_noise_at_a_large_sampling_rate_log_nothing(absl_records) -> None:  # type: ignore[no-untyped-def]
    epsilon = privacy.compute_epsilon(1.0, 0.25, 100, 1e-5)
    sigma = privacy.compute_noise_multiplier(3.0, 0.25, 100, 1e-5)
    curve = accounting.EpsilonCurve(1.0, 0.25, 1e-5)
    assert curve.epsilon(100) == pytest.approx(epsilon)
    assert 0 < epsilon < float("inf") and sigma > 1
    assert absl_records == []


def test_the_filter_is_only_around_the_librarys_calls(absl_records) -> None:  # type: ignore[no-untyped-def]
    dpa = accounting.dp_accounting()
    found = dpa.rdp.RdpAccountant()
    found.compose(accounting.dp_sgd_event(1.0, 0.25, 100))
    assert any("failed to converge" in message for message in absl_records)

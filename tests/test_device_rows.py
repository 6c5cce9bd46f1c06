"""`DeviceRows`: a step's values copied from the device once, when first read."""

from __future__ import annotations

import numpy as np
import pytest

from keras_gradtrack.engine.device_rows import DeviceRows, deferred


def rows_counting_fetches() -> tuple[DeviceRows, list[int]]:
    fetches: list[int] = []

    def fetch() -> dict[str, np.ndarray]:
        fetches.append(1)
        return {"loss": np.arange(4.0), "learning_rate": np.asarray(0.1)}

    host = {"batch_size": np.asarray(4), "example_id": np.arange(4) + 10}
    return DeviceRows(fetch, ["loss", "learning_rate"], host), fetches


def test_host_values_and_missing_names_copy_nothing() -> None:
    rows, fetches = rows_counting_fetches()
    assert int(rows["batch_size"]) == 4 and rows.get("example_id")[0] == 10
    assert rows.get("sketch") is None and "sketch" not in rows
    assert sorted(rows) == ["batch_size", "example_id", "learning_rate", "loss"]
    later = rows.deferred("loss")
    assert fetches == [] and not rows.fetched
    with pytest.raises(KeyError):
        rows.deferred("sketch")
    np.testing.assert_array_equal(np.asarray(later), np.arange(4.0))  # the copy, here
    np.testing.assert_array_equal(np.asarray(later, dtype=np.float32), np.arange(4.0))
    assert fetches == [1] and rows.fetched


def test_the_device_values_are_copied_once_and_read_as_numpy() -> None:
    rows, fetches = rows_counting_fetches()
    assert float(rows["learning_rate"]) == pytest.approx(0.1)
    np.testing.assert_array_equal(rows["loss"], np.arange(4.0))
    assert isinstance(deferred(rows, "loss"), np.ndarray)  # already copied: the array
    assert dict(rows).keys() == {"batch_size", "example_id", "learning_rate", "loss"}
    assert fetches == [1]
    assert deferred({"loss": 3}, "loss") == 3  # plain values pass through

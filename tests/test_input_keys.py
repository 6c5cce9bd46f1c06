"""A key of the input dict that is neither "example_id" nor an input is refused, with the
name it probably meant (a misspelt id key would log positions as ids)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradtrack as kgt

rng = np.random.default_rng(3)
X = rng.normal(size=(8, 4)).astype("float32")
Z = rng.normal(size=(8, 2)).astype("float32")
Y = rng.integers(0, 3, 8)
IDS = np.arange(100, 108)


def one_input() -> Any:
    inputs = keras.Input((4,), name="pixels")
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def two_inputs(as_dict: bool) -> Any:
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    outputs = keras.layers.Dense(3)(keras.layers.Concatenate()([a, b]))
    model = kgt.GradientTrackingModel({"a": a, "b": b} if as_dict else [a, b], outputs)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


class Subclassed(kgt.GradientTrackingModel):
    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )

    def call(self, inputs: Any) -> Any:
        return self.dense(keras.ops.concatenate([inputs["image"], inputs["extra"]], axis=-1))


def fit(model: Any, x: Any, path: Path) -> None:
    logger = kgt.HDF5GradientLogger(path, overwrite=True)
    model.fit(x, Y, batch_size=4, verbose=0, shuffle=False, callbacks=[logger])


def test_a_misspelt_id_key_is_refused_naming_example_id(tmp_path: Path) -> None:
    message = (
        "The input dict holds the key 'example_ids', which is neither 'example_id' (the "
        "example ids, logged with every row) nor an input of model 'functional' "
        "(['pixels']). Did you mean 'example_id'? Received keys: ['pixels', 'example_ids']"
    )
    model = one_input()
    with pytest.raises(
        ValueError, match=re.escape(message.replace("'functional'", f"{model.name!r}"))
    ):
        fit(model, {"pixels": X, "example_ids": IDS}, tmp_path / "run.h5")
    assert not (tmp_path / "run.h5").exists()


def test_a_key_beside_the_inputs_is_refused_naming_the_closest_input(tmp_path: Path) -> None:
    x = {"a": X, "b": Z, "bb": Z, "example_id": IDS}
    with pytest.raises(ValueError, match=r"key 'bb'.*\(\['a', 'b'\]\)\. Did you mean 'b'\?"):
        fit(two_inputs(as_dict=True), x, tmp_path / "r.h5")


def test_a_misspelt_id_key_of_a_dataset_is_refused(tmp_path: Path) -> None:
    data = tf.data.Dataset.from_tensor_slices(({"pixels": X, "exampleId": IDS}, Y)).batch(4)
    with pytest.raises(ValueError, match="Did you mean 'example_id'"):
        one_input().fit(data, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "r.h5")])


def test_a_misspelt_id_key_of_a_subclassed_model_is_refused(tmp_path: Path) -> None:
    x = {"image": X, "extra": Z, "example-id": IDS}
    with pytest.raises(ValueError, match=r"key 'example-id'.*Did you mean 'example_id'"):
        fit(Subclassed(), x, tmp_path / "r.h5")


@pytest.mark.parametrize(
    ("make_model", "x"),
    [
        (one_input, {"pixels": X, "example_id": IDS}),
        # With the ids and one other entry, that entry is the input whatever its key.
        (one_input, {"features": X, "example_id": IDS}),
        (lambda: two_inputs(as_dict=True), {"a": X, "b": Z, "example_id": IDS}),
        (lambda: two_inputs(as_dict=False), {"a": X, "b": Z, "example_id": IDS}),
        (Subclassed, {"image": X, "extra": Z, "example_id": IDS}),
    ],
    ids=["input_name", "any_single_key", "dict_inputs", "named_list_inputs", "subclassed"],
)
def test_dicts_of_the_models_inputs_and_ids_log_the_ids(
    tmp_path: Path, make_model: Any, x: dict[str, Any]
) -> None:
    fit(make_model(), x, tmp_path / "run.h5")
    with h5py.File(tmp_path / "run.h5", "r") as file:
        assert file["per_example/example_id"][:].tolist() == IDS.tolist()

"""On JAX: a model overriding Keras' methods with Keras' documented signatures trains
tracked (tests/keras_signatures.py); the library calls each as Keras' trainer does."""

from __future__ import annotations

from pathlib import Path

from keras_signatures import assert_overrides_train_tracked


def test_overrides_with_keras_signatures_train_tracked(tmp_path: Path) -> None:
    assert_overrides_train_tracked(tmp_path / "run.h5")

"""Attribution on JAX: the cases of `attribution_cases.py` (which PyTorch runs too), a
`train_step` of one's own, and the rows' transfers from the device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from attribution_cases import *  # noqa: F403 (the shared cases, collected here)
from attribution_cases import BATCH, MODELS, assert_matches_the_oracle_at_every_step, compiled, data

import keras_gradtrack as kgt
from keras_gradtrack.backends.jax import mixin


class OwnTrainStep(kgt.GradientTrackingModel):
    """Keras' step written out, with `tracked_value_and_grad` (docs/jax.md)."""

    def train_step(self, state: Any, data: Any) -> Any:
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = self.tracked_value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, aux), grads = grad_fn(
            trainable, non_trainable, metrics_variables, x, y, sample_weight,
            training=True, optimizer_variables=optimizer_variables,
        )  # fmt: skip
        _, _, non_trainable, metrics_variables = aux
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def test_an_own_train_step_matches_the_oracle_at_every_step(tmp_path: Path) -> None:
    assert_matches_the_oracle_at_every_step(
        compiled(MODELS["mlp"][0](OwnTrainStep)), (12,), tmp_path
    )


def test_the_target_rows_stay_on_the_device_until_their_block_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[int] = []
    unpacked = mixin.unpacked

    def counted(*args: Any) -> Any:
        copies.append(1)
        return unpacked(*args)

    monkeypatch.setattr(mixin, "unpacked", counted)
    copied_by_step: list[int] = []

    class Copies(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            copied_by_step.append(len(copies))

    rng = np.random.default_rng(5)
    x, y = data(rng, (12,), 6 * BATCH)
    model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
    logger = kgt.HDF5GradientLogger(
        tmp_path / "run.h5", targets=data(rng, (12,), 3), flush_every=4, flush_seconds=None
    )
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[logger, Copies()])
    # The first step's rows are read (checked) at once, the next ones with their block.
    assert copied_by_step[:3] == [1, 1, 1]
    assert len(copies) == 6

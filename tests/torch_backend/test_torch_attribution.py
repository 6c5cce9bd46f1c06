"""Attribution on PyTorch: the cases of `attribution_cases.py` (which JAX runs too), and
a `train_step` of one's own through `tracked_backward`."""

from __future__ import annotations

from pathlib import Path

from attribution_cases import *  # noqa: F403 (the shared cases, collected here)
from attribution_cases import MODELS, assert_matches_the_oracle_at_every_step, compiled
from test_torch_own_train_step import compute_loss_step_class

import keras_gradtrack as kgt


def test_an_own_train_step_matches_the_oracle_at_every_step(tmp_path: Path) -> None:
    model_class = compute_loss_step_class(kgt.GradientTrackingModel, True)
    assert_matches_the_oracle_at_every_step(
        compiled(MODELS["mlp"][0](model_class)), (12,), tmp_path
    )


def test_the_targets_batchless_search_runs_once_per_shape(tmp_path: Path, monkeypatch) -> None:
    """The targets' pass searches their batchless calls (two inference passes) once per
    plan and shape of the targets, not on every tracked step; the logs stay exact."""
    from keras_gradtrack.backends.torch import attribution

    searches: list[int] = []
    search = attribution.find_batchless_calls
    monkeypatch.setattr(
        attribution, "find_batchless_calls", lambda *a: searches.append(1) or search(*a)
    )
    model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
    assert_matches_the_oracle_at_every_step(model, (12,), tmp_path)
    assert len(searches) == 1

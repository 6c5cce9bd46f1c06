"""What a gradient logger records of a private model: the pre-clip norms, the fraction
clipped per step (with adaptive clipping, the step's bound), and the privacy settings as
the log's attributes. In `keras.ops`: both engines' loggers use it."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from keras import ops

from keras_gradtrack.engine import private_training
from keras_gradtrack.engine.clip_weights import clip_weights
from keras_gradtrack.engine.private_settings import config_of, settings_of
from keras_gradtrack.privacy.history import history_json
from keras_gradtrack.statistics import GradNorm, Statistic, StepPrimitives


class DPGradNorm(GradNorm):
    """`(B,)` each example's gradient norm before clipping, `||g_i||` (`grad_norm`)."""

    name = "dp_grad_norm"


class PrivateModelStatistic(Statistic):
    """A per-step value read from the private `model` (its settings, its bound)."""

    per_example = False
    needs_dot = False

    def __init__(self, model: Any) -> None:
        self.model = model


class DPFractionClipped(PrivateModelStatistic):
    """Per step: the fraction of examples whose gradient was clipped (`||g_i|| > C`,
    or, with bounds per group, `||g_i^(k)|| > C_k` for some group k)."""

    name = "dp_fraction_clipped"

    def compute(self, primitives: StepPrimitives) -> Any:
        settings = settings_of(self.model)
        assert settings is not None
        sq_norm = ops.maximum(ops.cast(primitives.sq_norm, "float32"), 0.0)
        sq_norms = [sq_norm[:, k] for k in range(sq_norm.shape[1])]
        bound = settings.sensitivity
        if settings.adaptive_clip is not None:
            bound = ops.convert_to_tensor(self.model.__dict__["_adaptive_clip_bound"])
        plan = self.model.gradient_tracking_plan()
        _, clipped = clip_weights(settings, self.model, plan, sq_norms, bound)
        return ops.mean(ops.cast(clipped, "float32"))


class DPL2NormClip(PrivateModelStatistic):
    """Per step, with adaptive clipping: the bound `C_t` the step clipped to (before the
    step's update of it). The private step's own value (`PrivateStep.rows`) takes this
    column's place in the step's payload; the value computed here is the bound variable
    as the statistics read it."""

    name = "dp_l2_norm_clip"

    def compute(self, primitives: StepPrimitives) -> Any:
        return ops.convert_to_tensor(self.model.__dict__["_adaptive_clip_bound"])


def privacy_statistics(model: Any) -> list[Statistic]:
    """What a gradient logger adds for a private model (none for another model)."""
    settings = settings_of(model)
    if settings is None:
        return []
    found: list[Statistic] = [DPGradNorm(), DPFractionClipped(model)]
    if settings.adaptive_clip is not None:
        found.append(DPL2NormClip(model))
    return found


def privacy_attrs(model: Any) -> dict[str, Any]:
    """The log's root attributes describing a private model's settings (none otherwise)."""
    settings = settings_of(model)
    if settings is None:
        return {}
    bound, budget = settings.l2_norm_clip, settings.budget
    config = config_of(model)
    assert config is not None
    return {
        "dp_l2_norm_clip": settings.sensitivity,
        "dp_per_layer_clip": json.dumps(dict(bound)) if isinstance(bound, Mapping) else "",
        "dp_clip_groups": json.dumps(config["groups"]) if config["groups"] else "",
        "dp_noise_multiplier": settings.noise_multiplier,
        "dp_expected_batch_size": (
            float("nan") if settings.expected_batch_size is None else settings.expected_batch_size
        ),
        "dp_secure_noise": settings.secure_noise,
        "dp_adaptive_clip": (
            json.dumps(dataclasses.asdict(settings.adaptive_clip)) if settings.adaptive_clip else ""
        ),
        "dp_sampling": settings.sampling,
        "dp_accumulation_steps": settings.accumulation_steps,
        "dp_target_epsilon": math.nan if budget is None else budget.target_epsilon,
        "dp_target_delta": math.nan if budget is None else budget.delta,
        "dp_privacy_history": history_json(private_training.history(model)),
    }


def privacy_spent_attrs(model: Any) -> dict[str, Any]:
    """The privacy spent so far, as the log's root attributes: the model's privacy
    history (`dp_privacy_history`, JSON), and the epsilon of its `PrivacyAccountant`
    (the last one a `fit` of the model used), if any."""
    if settings_of(model) is None:
        return {}
    spent = {"dp_privacy_history": history_json(private_training.history(model))}
    accountant = getattr(model, "__dict__", {}).get("_privacy_accountant")
    if accountant is not None:
        spent.update(accountant.spent_attrs())
    return spent

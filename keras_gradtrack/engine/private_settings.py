"""What `make_private` fixes: the clipping bound(s), their groups of layers, the noise.

One bound `C` clips each example's whole gradient. Bounds per group of layers clip
each example's gradient restricted to group k, `g_i^(k)`, to `C_k`; the
sensitivity is then `sqrt(sum_k C_k^2)`. A bound per tracked layer is the case of
groups of one layer. Each tracked layer is in exactly one group: a layer in none
would have an unbounded gradient, one in two would be clipped twice.

Plain Python and Keras (a plan is the model's own, `gradient_tracking_plan()`), so
that every backend's engine shares it; `clip_weights` is the clipping in `keras.ops`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_gradtrack._keras_seam import flatten_layers
from keras_gradtrack.privacy.adaptive_clip import AdaptiveClip, gradient_noise_multiplier
from keras_gradtrack.privacy.budget import PrivacyBudget

if TYPE_CHECKING:
    from keras_gradtrack.engine.plan import Plan


@dataclasses.dataclass(frozen=True)
class PrivacySettings:
    """What `make_private` fixed: the clipping bound(s), the noise, the batch size.

    Attributes:
        l2_norm_clip: `C`, the bound on each example's gradient norm (all layers
            together), or `{group name: C_k}`, one bound per group (per tracked
            layer, keyed by its name, when `groups` is None).
        noise_multiplier: `sigma`: the noise's standard deviation is `sigma C`
            (`sigma sqrt(sum_k C_k^2)` with bounds per group).
        expected_batch_size: `B_expected`, the divisor of the noisy sum; None: the
            step's own (global) batch size.
        seed: The base seed of the noise (drawn from Keras' seed at `make_private`).
        groups: `{group name: members}`, each member a layer or a layer's name (a
            tracked layer, or a layer holding tracked layers: all of them); None:
            one group per key of `l2_norm_clip` (a tracked layer's name), or no
            groups for a single bound.
        secure_noise: Whether the noise is drawn in float64 from the operating
            system's cryptographically secure generator (`privacy/secure_noise.py`),
            not seeded; False: the seeded float32 Box-Muller draw.
        adaptive_clip: How the bound moves toward a quantile of the norms (one
            bound only), or None for a fixed bound.
    """

    l2_norm_clip: float | Mapping[str, float]
    noise_multiplier: float
    expected_batch_size: float | None
    seed: int
    groups: Mapping[str, tuple[Any, ...]] | None = None
    secure_noise: bool = False
    adaptive_clip: AdaptiveClip | None = None
    sampling_rate: float | None = None
    dataset_size: int | None = None
    sampling: str = "unknown"
    accumulation_steps: int = 1
    budget: PrivacyBudget | None = None

    @property
    def per_layer(self) -> bool:
        """Whether the bounds are per group (per layer) rather than one for all layers."""
        return isinstance(self.l2_norm_clip, Mapping)

    @property
    def sensitivity(self) -> float:
        """The bound on the norm of one example's clipped gradient (all layers)."""
        if isinstance(self.l2_norm_clip, Mapping):
            return math.sqrt(sum(c * c for c in self.l2_norm_clip.values()))
        return float(self.l2_norm_clip)

    @property
    def gradient_noise_multiplier(self) -> float:
        """The clipped sum's noise multiplier: `noise_multiplier`, or with adaptive
        clipping the lower one that leaves room for the count's noise."""
        if self.adaptive_clip is None:
            return self.noise_multiplier
        return gradient_noise_multiplier(
            self.noise_multiplier, self.adaptive_clip.clipped_count_stddev
        )


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """The groups resolved on a model's plan: each group's name, bound and tracked
    layers (column names), and each tracked layer's group (index, plan order)."""

    names: tuple[str, ...]
    bounds: tuple[float, ...]
    members: tuple[tuple[str, ...], ...]
    index: tuple[int, ...]


def settings_of(model: Any) -> PrivacySettings | None:
    """The model's privacy settings, or None if it trains without privacy."""
    return getattr(model, "__dict__", {}).get("_privacy_settings")


def layer_groups(settings: PrivacySettings, model: Any, plan: Plan) -> LayerGroups | None:
    """The settings' groups on `plan` (None for one bound over all layers).

    Raises:
        ValueError: A member that is no layer of the model or holds no tracked
            layer, a tracked layer in two groups or in none, or groups that do
            not match the bounds' keys.
    """
    bounds = settings.l2_norm_clip
    if not isinstance(bounds, Mapping):
        return None
    names = [tracked.name for tracked in plan]
    if settings.groups is None:
        if sorted(bounds) != sorted(names):
            raise ValueError(
                "Expected l2_norm_clip to give one bound per tracked layer "
                f"(model.tracked_layer_names: {names}), or bounds per group with "
                f"`groups=`. Received: {sorted(bounds)}"
            )
        groups: Mapping[str, Sequence[Any]] = {name: (name,) for name in bounds}
    else:
        groups = settings.groups
    of_layer: dict[str, str] = {}
    members = []
    for group, given in groups.items():
        found = [name for member in given for name in tracked_names_of(member, model, plan)]
        for name in found:
            if of_layer.get(name, group) != group:
                raise ValueError(
                    f"Layer {name!r} is in groups {of_layer[name]!r} and {group!r}: each "
                    "tracked layer must be in exactly one group."
                )
            of_layer[name] = group
        members.append(tuple(dict.fromkeys(found)))
    missing = [name for name in names if name not in of_layer]
    if missing:
        raise ValueError(
            f"Tracked layers {missing} of model {model.name!r} are in no group: each "
            "tracked layer must be in exactly one group (an ungrouped layer's gradient "
            f"would not be bounded). Received groups: {describe(groups)}"
        )
    group_names = tuple(groups)
    return LayerGroups(
        group_names,
        tuple(float(bounds[group]) for group in group_names),
        tuple(members),
        tuple(group_names.index(of_layer[name]) for name in names),
    )


def tracked_names_of(member: Any, model: Any, plan: Plan) -> list[str]:
    """The tracked layers (column names) a group member stands for: a tracked layer
    or its column name, or every tracked layer inside a layer (or a layer's name)."""
    if isinstance(member, str):
        columns = [tracked.name for tracked in plan if tracked.name == member]
        if columns:
            return columns
        holders = [layer for layer in flatten_layers(model) if layer.name == member]
    else:
        holders = [member]
    inside = {id(layer) for holder in holders for layer in flatten_layers(holder)}
    found = [tracked.name for tracked in plan if id(tracked.layer) in inside]
    if not found:
        what = repr(member) if isinstance(member, str) else f"layer {member.name!r}"
        raise ValueError(
            f"Expected each member of `groups` to be a tracked layer of model "
            f"{model.name!r}, its name, or a layer holding tracked layers "
            f"(model.tracked_layer_names: {[t.name for t in plan]}). Received: {what}, "
            "which names no tracked layer."
        )
    return found


def describe(groups: Mapping[str, Sequence[Any]]) -> dict[str, list[str]]:
    """The groups with each member shown by its name (for messages and configs)."""
    return {
        group: [m if isinstance(m, str) else str(m.name) for m in members]
        for group, members in groups.items()
    }


def validated_settings(
    model: Any,
    l2_norm_clip: Any,
    noise_multiplier: Any,
    expected_batch_size: Any,
    groups: Any = None,
    secure_noise: Any = False,
    adaptive_clip: Any = None,
) -> PrivacySettings:
    """The settings of `make_private`, checked; refuses, before any step, what cannot be private.

    Raises:
        ValueError: On an invalid argument, an uncompiled model, or a model that
            cannot train privately (BatchNormalization in training mode).
    """

    def positive(name: str, value: Any, allow_zero: bool = False) -> float:
        valid = isinstance(value, (int, float)) and not isinstance(value, bool)
        if valid and math.isfinite(value) and (value > 0 or (allow_zero and value == 0)):
            return float(value)
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"Expected {name} to be {kind} finite number. Received: {name}={value!r}")

    members = None if groups is None else checked_groups(groups)
    if isinstance(l2_norm_clip, Mapping):
        if not l2_norm_clip:
            raise ValueError("Expected l2_norm_clip to name at least one layer. Received: {}")
        bounds: float | dict[str, float] = {
            str(name): positive(f"l2_norm_clip[{name!r}]", value)
            for name, value in l2_norm_clip.items()
        }
    else:
        bounds = positive("l2_norm_clip", l2_norm_clip)
        if members is not None:  # the same bound for every group
            bounds = dict.fromkeys(members, bounds)
    if members is not None:
        named = sorted(bounds) if isinstance(bounds, dict) else []
        if named != sorted(members):
            raise ValueError(
                "Expected l2_norm_clip to give one bound per group of `groups`. Received "
                f"bounds for {named} and groups {sorted(members)}"
            )
    sigma = positive("noise_multiplier", noise_multiplier, allow_zero=True)
    expected = None
    if expected_batch_size is not None:
        expected = positive("expected_batch_size", expected_batch_size)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"Model {model.name!r} is not compiled: call `compile(optimizer=..., loss=...)` "
            "before `make_private`."
        )
    if getattr(model, "steps_per_execution", 1) > 1:
        raise ValueError(steps_per_execution_refusal(model.steps_per_execution))
    if getattr(model, "track_batch_normalization", False) or any(
        isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        for layer in flatten_layers(model, include_self=False)
    ):
        raise ValueError(batch_normalization_refusal(model))
    seed = int(keras.random.randint((), 0, 2**31 - 1, seed=keras.random.SeedGenerator()))
    settings = PrivacySettings(
        bounds, sigma, expected, seed, members, *checked_noise(model, secure_noise, adaptive_clip)
    )
    if settings.adaptive_clip is not None:
        if isinstance(bounds, dict):
            raise ValueError(
                "Adaptive clipping moves one bound: expected a float l2_norm_clip "
                f"without groups. Received: l2_norm_clip={l2_norm_clip!r}, groups={groups!r}"
            )
        gradient_noise_multiplier(
            sigma, settings.adaptive_clip.clipped_count_stddev
        )  # refuses 2 sigma_b <= sigma
    if model.built:
        layer_groups(settings, model, model.gradient_tracking_plan())  # refuses bad groups now
    return settings


def checked_noise(model: Any, secure_noise: Any, adaptive_clip: Any) -> tuple[bool, Any]:
    """`secure_noise` and `adaptive_clip` of `make_private`, checked."""
    if not isinstance(secure_noise, bool):
        raise ValueError(f"Expected secure_noise to be a bool. Received: {secure_noise!r}")
    # On JAX the draw runs on the host through a callback the compiled step makes.
    xla = getattr(model, "jit_compile", False) is True and keras.backend.backend() != "jax"
    if secure_noise and xla:
        raise ValueError(
            "secure_noise=True draws its random bits on the host (`os.urandom`), which "
            "XLA cannot compile: compile the model with `jit_compile=False`. "
            "Received: jit_compile=True"
        )
    if isinstance(adaptive_clip, Mapping):  # as a saved model's config holds it
        adaptive_clip = AdaptiveClip(**adaptive_clip)
    if adaptive_clip is not None and not isinstance(adaptive_clip, AdaptiveClip):
        raise ValueError(
            "Expected adaptive_clip to be a keras_gradtrack.privacy.AdaptiveClip or None. "
            f"Received: adaptive_clip={adaptive_clip!r}"
        )
    return secure_noise, adaptive_clip


def checked_groups(groups: Any) -> dict[str, tuple[Any, ...]]:
    """`groups` as `{name: members}`; raises on what is not a mapping of non-empty lists."""
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(
            "Expected groups to be a non-empty dict {group name: [layers or layer "
            f"names]}}. Received: groups={groups!r}"
        )
    checked = {}
    for name, members in groups.items():
        members = (members,) if isinstance(members, (str, keras.layers.Layer)) else members
        members = tuple(members) if isinstance(members, Sequence) else ()
        if not members or not all(isinstance(m, (str, keras.layers.Layer)) for m in members):
            raise ValueError(
                f"Expected group {name!r} to be a non-empty list of layers or layer names. "
                f"Received: {groups[name]!r}"
            )
        checked[str(name)] = members
    return checked


def config_of(model: Any) -> dict[str, Any] | None:
    """The settings as plain values for the model's saved config (groups by name), or
    None for a model without privacy. The seed is not saved: a loaded model draws its
    own, as `make_private` does."""
    settings = settings_of(model)
    if settings is None:
        return None
    bound = settings.l2_norm_clip
    groups = None
    if settings.groups is not None:
        if model.built:
            found = layer_groups(settings, model, model.gradient_tracking_plan())
            assert found is not None
            groups = {name: list(members) for name, members in zip(found.names, found.members)}
        else:
            groups = describe(settings.groups)
    adaptive_bound = getattr(model, "__dict__", {}).get("_adaptive_clip_bound")
    if settings.adaptive_clip is not None and adaptive_bound is not None:
        bound = float(adaptive_bound.numpy())  # a loaded model goes on from the bound reached
    budget = settings.budget
    return {
        "l2_norm_clip": dict(bound) if isinstance(bound, Mapping) else bound,
        "noise_multiplier": settings.noise_multiplier,
        "expected_batch_size": settings.expected_batch_size,
        "groups": groups,
        "secure_noise": settings.secure_noise,
        "adaptive_clip": (
            None if settings.adaptive_clip is None else dataclasses.asdict(settings.adaptive_clip)
        ),
        "sampling_rate": settings.sampling_rate,
        "dataset_size": settings.dataset_size,
        "accumulation_steps": settings.accumulation_steps,
        "target_epsilon": None if budget is None else budget.target_epsilon,
        "delta": None if budget is None else budget.delta,
        "accountant": "rdp" if budget is None else budget.accountant,
    }


def batch_normalization_refusal(model: Any) -> str:
    return (
        f"Model {model.name!r} has BatchNormalization in training mode: each example's "
        "output depends on the other examples of the batch, so one example's influence "
        "cannot be bounded by clipping and the model cannot be trained privately. "
        "Replace it with `model = kgt.convert_to_group_normalization(model)` "
        "(GroupNormalization normalizes each example alone), or freeze the layers "
        "(`layer.trainable = False` runs them in inference mode)."
    )


def steps_per_execution_refusal(steps: int) -> str:
    return (
        "Private training counts its steps for the accountant one by one, so it needs "
        "`steps_per_execution=1` in `compile()`. "
        f"Received: steps_per_execution={steps}"
    )

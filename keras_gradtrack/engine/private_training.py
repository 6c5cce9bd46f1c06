"""A private model's bookkeeping: its phases, their steps, its budget, the batches it trains on.

`make_private` starts a phase `(sigma, q, steps=0)` and keeps the phases before it;
each private step (one optimizer update: one logical batch) adds to the current
phase. A budget `(target_epsilon, delta)` is checked on the host before each step
runs. Plain Python and Keras: no backend's names, so every backend shares it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import keras

from keras_gradtrack.engine import private_settings
from keras_gradtrack.privacy import accounting, budget
from keras_gradtrack.privacy.history import POISSON, SHUFFLED, UNKNOWN, PrivacyPhase, with_rate

HISTORY_KEY = "_privacy_history"
# The steps the budget still allows: `(phases it was computed for, steps)`.
STEPS_LEFT_KEY = "_privacy_steps_left"
# How many Binomial standard deviations a Poisson batch may lie from its mean.
POISSON_DEVIATIONS = 5.0


def history(model: Any) -> tuple[PrivacyPhase, ...]:
    """The model's phases, the current one last (empty for a model never made private)."""
    return tuple(model.__dict__.get(HISTORY_KEY, ()))


def set_history(model: Any, phases: Any) -> None:
    model.__dict__[HISTORY_KEY] = list(phases)


def current(model: Any) -> PrivacyPhase | None:
    phases = history(model)
    return phases[-1] if phases else None


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected {name} to be a positive integer. Received: {name}={value!r}")
    return value


def rate_and_sampling(
    sampling_rate: Any, dataset_size: Any, expected_batch_size: Any
) -> tuple[float | None, int | None, float | None, str]:
    """`(q, N, B_expected, sampling)` from `make_private`'s arguments, checked."""
    if dataset_size is not None:
        dataset_size = positive_int("dataset_size", dataset_size)
    if sampling_rate is not None:
        if not isinstance(sampling_rate, (int, float)) or not 0 < sampling_rate <= 1:
            raise ValueError(
                f"Expected sampling_rate in (0, 1]. Received: sampling_rate={sampling_rate!r}"
            )
        rate = float(sampling_rate)
        if dataset_size is not None and expected_batch_size is None:
            expected_batch_size = rate * dataset_size
        return rate, dataset_size, expected_batch_size, POISSON
    if dataset_size is None:
        return None, None, expected_batch_size, UNKNOWN
    shuffled_rate = None
    if expected_batch_size is not None:
        shuffled_rate = min(1.0, float(expected_batch_size) / dataset_size)
    return shuffled_rate, dataset_size, expected_batch_size, SHUFFLED


def start_phase(
    model: Any,
    settings: private_settings.PrivacySettings,
    target_epsilon: float | None,
    epochs: float | None,
) -> None:
    """Starts the phase of `settings` (its sigma found for a target first): the model's
    settings, its history and its optimizer's accumulation. A current phase without
    steps is replaced."""
    spent = [phase for phase in history(model) if phase.steps]
    sigma = settings.noise_multiplier
    rate = settings.sampling_rate
    if target_epsilon is not None and rate is None:
        raise ValueError(
            "A target epsilon needs the sampling rate: pass `sampling_rate=q`, or "
            "`dataset_size=n` with `expected_batch_size=`. Received neither."
        )
    if target_epsilon is not None and math.isnan(sigma):
        assert settings.budget is not None and rate is not None
        if not isinstance(epochs, (int, float)) or isinstance(epochs, bool) or epochs <= 0:
            raise ValueError(
                "A target epsilon needs the planned training: pass `epochs=` (> 0). "
                f"Received: epochs={epochs!r}"
            )
        planned = math.ceil(epochs / rate)
        sigma = accounting.compute_noise_multiplier(
            settings.budget.target_epsilon,
            rate,
            planned,
            settings.budget.delta,
            settings.budget.accountant,
            prior=with_rate(spent, None),
        )
        print(
            f"make_private: noise_multiplier={sigma:.6g} keeps {planned} steps at "
            f"sampling_rate={rate:.6g} (after {len(spent)} earlier "
            f"phases) within epsilon={target_epsilon} at delta={settings.budget.delta}"
        )
        settings = dataclasses.replace(settings, noise_multiplier=sigma)
    set_history(model, [*spent, PrivacyPhase(sigma, settings.sampling_rate, 0, settings.sampling)])
    k = settings.accumulation_steps
    if k > 1 or getattr(model.optimizer, "gradient_accumulation_steps", None):
        model.optimizer.gradient_accumulation_steps = k if k > 1 else None
    model.__dict__["_privacy_settings"] = settings
    model.__dict__.pop(STEPS_LEFT_KEY, None)


def record_steps(model: Any, steps: int) -> None:
    """Adds `steps` private steps (optimizer updates) to the current phase."""
    phases = list(history(model))
    if steps and phases:
        phases[-1] = dataclasses.replace(phases[-1], steps=phases[-1].steps + steps)
        set_history(model, phases)


class UpdateCount:
    """The optimizer updates (private steps) a call of the train function makes.

    Without accumulation, one per call; with `k > 1`, the change of the optimizer's
    `iterations` (which Keras counts in logical batches), read before and after."""

    def __init__(self, model: Any) -> None:
        self.optimizer = model.optimizer
        settings = private_settings.settings_of(model)
        self.accumulating = settings is not None and settings.accumulation_steps > 1
        self.before = self.iterations() if self.accumulating else 0

    def iterations(self) -> int:
        return int(keras.ops.convert_to_numpy(self.optimizer.iterations))

    def since(self) -> int:
        return self.iterations() - self.before if self.accumulating else 1


def fit_data(x: Any, kwargs: dict[str, Any]) -> tuple[int | None, int | None]:
    """`(examples, batches per epoch)` of `fit`'s input where it says them: numpy
    arrays (less `validation_split`), or a dataset's cardinality (None where unknown)."""
    if x is None:
        return None, None
    cardinality = getattr(x, "cardinality", None)
    if callable(cardinality):
        batches = int(keras.ops.convert_to_numpy(cardinality()))
        known = batches > 0 and kwargs.get("steps_per_epoch") is None
        return None, batches if known else None
    leaves = keras.tree.flatten(x)
    if not leaves or not all(hasattr(leaf, "shape") and len(leaf.shape) for leaf in leaves):
        return None, None
    examples = int(leaves[0].shape[0])
    split = kwargs.get("validation_split") or 0.0
    if split:
        examples = math.ceil(examples * (1.0 - split))
    return examples, None


def budget_steps_left(model: Any) -> int | None:
    """Steps the model's budget still allows in the current phase (None: no budget)."""
    settings = private_settings.settings_of(model)
    phases = history(model)
    if settings is None or settings.budget is None or not phases:
        return None
    phase = phases[-1]
    spent = with_rate(phases[:-1], None)
    key = (spent, phase.noise_multiplier, phase.sampling_rate)
    known = model.__dict__.get(STEPS_LEFT_KEY)
    if known is None or known[0] != key:
        assert phase.sampling_rate is not None
        found = budget.steps_left(
            settings.budget, spent, phase.noise_multiplier, phase.sampling_rate
        )
        known = model.__dict__[STEPS_LEFT_KEY] = (key, found)
    return max(0, known[1] - phase.steps)


def budget_refusal(model: Any) -> str:
    settings = private_settings.settings_of(model)
    assert settings is not None and settings.budget is not None
    spent = accounting.history_epsilon(
        with_rate(history(model), None), settings.budget.delta, settings.budget.accountant
    )
    return (
        f"The privacy budget of model {model.name!r} is spent: one more step would take "
        f"epsilon past target_epsilon={settings.budget.target_epsilon} at "
        f"delta={settings.budget.delta} (spent: epsilon={spent:.4g} over "
        f"{sum(p.steps for p in history(model))} steps). Received history: "
        f"{list(history(model))}"
    )


def step_allowed(model: Any) -> bool:
    """Whether the budget allows the next step; if not, stops `fit` with a warning.

    Checked on the host before each step; with accumulation, before each physical
    step (a logical batch the budget cannot finish is not begun)."""
    left = budget_steps_left(model)
    if left is None or left > 0:
        return True
    warnings.warn(budget_refusal(model) + " Training stops here.", stacklevel=3)
    model.stop_training = True
    return False


def check_batches(
    model: Any, dataset_size: int | None, batch_size: int | None, batches: int | None
) -> None:
    """Checks what `fit` received against the settings, before any step.

    A shuffled phase given only `dataset_size` takes its sampling rate from the
    first batch here (`k * batch / N`).

    Args:
        model: The private model.
        dataset_size: The training examples `fit` will draw from, where it knows
            them (numpy arrays), else None.
        batch_size: The size of `fit`'s first batch, else None.
        batches: The batches of an epoch, where known (a dataset's cardinality).

    Raises:
        ValueError: A dataset size or batch size other than the settings imply.
    """
    settings = private_settings.settings_of(model)
    if settings is None or batch_size is None:
        return
    k, n, q = settings.accumulation_steps, settings.dataset_size, settings.sampling_rate
    if n is not None and dataset_size is not None and dataset_size != n:
        raise ValueError(
            f"make_private was given dataset_size={n}, but fit received {dataset_size} "
            "training examples. Pass the dataset size fit trains on."
        )
    if (
        settings.sampling == SHUFFLED
        and dataset_size is None
        and batches is not None
        and not (batches - 1) * batch_size < (n or 0) <= batches * batch_size
    ):
        raise ValueError(
            f"make_private was given dataset_size={n}, but fit received {batches} "
            f"batches of {batch_size} examples ({(batches - 1) * batch_size + 1} to "
            f"{batches * batch_size} examples)."
        )
    if settings.sampling == SHUFFLED:
        if q is None:
            assert n is not None
            rate = min(1.0, k * batch_size / n)
            set_rate(model, dataclasses.replace(settings, sampling_rate=rate))
            return
        assert n is not None
        expected = min(n, round(q * n / k))
        if batch_size != expected:
            raise ValueError(
                f"make_private's sampling (shuffled batches, sampling_rate={q:.6g}, "
                f"dataset_size={n}, accumulation_steps={k}) means batches of {expected} "
                f"examples, but fit received a batch of {batch_size}."
            )
    elif settings.sampling == POISSON and q is not None:
        size = n if n is not None else dataset_size
        if size is not None:
            mean, deviation = q * size, math.sqrt(size * q * (1 - q))
        elif settings.expected_batch_size is not None:
            mean = settings.expected_batch_size
            deviation = math.sqrt(mean)
        else:
            return
        low = (mean - POISSON_DEVIATIONS * deviation) / k - 1
        high = (mean + POISSON_DEVIATIONS * deviation) / k + 1
        if not low <= batch_size <= high:
            raise ValueError(
                f"make_private's sampling (Poisson, sampling_rate={q:.6g}, expected "
                f"logical batch {mean:.6g}, accumulation_steps={k}) means batches of "
                f"{max(low, 0):.1f} to {high:.1f} examples ({POISSON_DEVIATIONS:g} "
                f"standard deviations), but fit received a batch of {batch_size}."
            )


def set_rate(model: Any, settings: private_settings.PrivacySettings) -> None:
    """Fixes the current phase's sampling rate (found from `fit`'s first batch)."""
    model.__dict__["_privacy_settings"] = settings
    phases = list(history(model))
    if phases:
        phases[-1] = dataclasses.replace(phases[-1], sampling_rate=settings.sampling_rate)
        set_history(model, phases)


def epsilon(model: Any, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at `delta` of the model's whole history (all phases, composed)."""
    return accounting.history_epsilon(with_rate(history(model), None), delta, accountant)


def checked_accumulation_steps(model: Any, given: Any) -> int:
    """`k` of `make_private(accumulation_steps=k)`, set on the optimizer as Keras' own
    `gradient_accumulation_steps` (its accumulators sum each physical batch's clipped
    sum; the private step adds the noise on the k-th). An optimizer compiled with
    `gradient_accumulation_steps` gives `k` when none is given.

    Raises:
        ValueError: On a `k` other than the optimizer's, once the optimizer is built
            (its accumulators are made when it is built), or a loss-scale optimizer.
    """
    optimizer = model.optimizer
    own = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    k = own if given is None else positive_int("accumulation_steps", given)
    if k == own:
        return k
    if getattr(optimizer, "built", False):
        raise ValueError(
            f"The optimizer of model {model.name!r} is built with "
            f"gradient_accumulation_steps={own if own > 1 else None}: its accumulators "
            "are made when it is built. Compile with an optimizer of "
            f"`gradient_accumulation_steps={k if k > 1 else None}` to accumulate "
            f"{k} batches. Received: accumulation_steps={given!r}"
        )
    if hasattr(optimizer, "inner_optimizer"):
        raise ValueError(
            "Private training accumulates batches on the optimizer itself; a "
            "LossScaleOptimizer wraps it. Received: accumulation_steps="
            f"{given!r} with {type(optimizer).__name__}"
        )
    return k


def checked_budget(target_epsilon: Any, delta: Any, accountant: str) -> budget.PrivacyBudget | None:
    """The budget of `make_private(target_epsilon=, delta=, accountant=)`, checked; None
    without a target."""
    if target_epsilon is None:
        return None
    accounting.check_arguments(1.0, 0, delta, accountant)
    if not isinstance(target_epsilon, (int, float)) or not 0 < target_epsilon < math.inf:
        raise ValueError(
            f"Expected target_epsilon > 0. Received: target_epsilon={target_epsilon!r}"
        )
    return budget.PrivacyBudget(float(target_epsilon), float(delta), accountant)

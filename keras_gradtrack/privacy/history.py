"""A model's private training as a history of phases `(sigma, q, steps)`.

Each `make_private` starts a phase; the steps of the current phase are counted as
they run. Epsilon is the composition of every phase (`accounting.history_epsilon`).
The history is kept as plain values (no backend), so that it is saved with the
model, written into logs and checkpoints, and read back the same on every backend.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

# How each step's batch was drawn: Poisson sampling (`poisson_batches`), shuffled
# batches of a fixed size (accounted as if Poisson: an approximation), or not said.
POISSON = "poisson"
SHUFFLED = "shuffled"
UNKNOWN = "unknown"
SAMPLINGS = (POISSON, SHUFFLED, UNKNOWN)


@dataclasses.dataclass(frozen=True)
class PrivacyPhase:
    """One phase of private training: `steps` steps of noise `sigma` at rate `q`.

    Attributes:
        noise_multiplier: `sigma`, the noise's standard deviation over the bound.
        sampling_rate: `q`, each example's probability to be in a (logical) batch;
            None where `make_private` was given neither `sampling_rate` nor
            `dataset_size` (a `PrivacyAccountant(sampling_rate=...)` supplies it).
        steps: The private steps (optimizer updates) of the phase so far.
        sampling: `"poisson"`, `"shuffled"` (fixed-size batches, accounted as if
            Poisson-sampled) or `"unknown"`.

    Example:

    ```python
    model.privacy_history
    # (PrivacyPhase(noise_multiplier=1.1, sampling_rate=0.01, steps=300, sampling='poisson'),)
    ```
    """

    noise_multiplier: float
    sampling_rate: float | None
    steps: int
    sampling: str = UNKNOWN

    def as_dict(self) -> dict[str, Any]:
        """The phase as plain values (for JSON)."""
        return dataclasses.asdict(self)


def history_json(phases: Sequence[PrivacyPhase]) -> str:
    """The phases as a JSON list of objects (a log's or a checkpoint's attribute).

    Example:

    ```python
    history_json(model.privacy_history)
    # '[{"noise_multiplier": 1.1, "sampling_rate": 0.01, "steps": 300, "sampling": "poisson"}]'
    ```
    """
    return json.dumps([phase.as_dict() for phase in phases])


def phases_from(values: Iterable[Any]) -> tuple[PrivacyPhase, ...]:
    """Phases from plain values (dicts as `as_dict` writes them, or phases), checked.

    Raises:
        ValueError: On an entry that is not a phase.
    """
    phases = []
    for value in values:
        if isinstance(value, PrivacyPhase):
            phases.append(value)
            continue
        try:
            rate = value["sampling_rate"]
            phase = PrivacyPhase(
                float(value["noise_multiplier"]),
                None if rate is None else float(rate),
                int(value["steps"]),
                str(value.get("sampling", UNKNOWN)),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                "Expected each phase of a privacy history to hold noise_multiplier, "
                f"sampling_rate and steps. Received: {value!r}"
            ) from error
        if phase.steps < 0 or phase.sampling not in SAMPLINGS:
            raise ValueError(f"Expected a valid privacy phase. Received: {value!r}")
        phases.append(phase)
    return tuple(phases)


def phases_from_json(text: str) -> tuple[PrivacyPhase, ...]:
    """The phases of `history_json`'s text (an empty string: none)."""
    return phases_from(json.loads(text)) if text else ()


def with_rate(phases: Sequence[PrivacyPhase], rate: float | None) -> tuple[PrivacyPhase, ...]:
    """The phases, those without a sampling rate taking `rate`.

    Raises:
        ValueError: Where a phase's rate is unknown and `rate` is None.
    """
    if rate is None and any(phase.sampling_rate is None for phase in phases if phase.steps):
        raise ValueError(
            "The sampling rate of a private phase is unknown: pass `sampling_rate=q` or "
            "`dataset_size=n` to `make_private` (or `sampling_rate=` to the accountant). "
            f"Received history: {list(phases)}"
        )
    return tuple(
        dataclasses.replace(phase, sampling_rate=rate) if phase.sampling_rate is None else phase
        for phase in phases
    )

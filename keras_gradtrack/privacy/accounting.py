"""The privacy spent by DP-SGD: epsilon for a delta, and the noise for a target epsilon.

Built on Google's `dp-accounting` package (`pip install "keras-gradtrack[privacy]"`),
with its RDP or PLD accountant. The mechanism is the Poisson-subsampled Gaussian:
every step samples each example independently with probability `sampling_rate`
(`poisson_batches`) and adds Gaussian noise of standard deviation
`noise_multiplier` times the clipping bound. Shuffled batches of a fixed size are
accounted as if they were Poisson-sampled, as TensorFlow Privacy and Opacus do:
an assumption, not a guarantee.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from keras_gradtrack.privacy.history import PrivacyPhase

ACCOUNTANTS = ("rdp", "pld")


def dp_accounting() -> Any:
    """The `dp_accounting` module, or a clear error naming the extra that installs it."""
    try:
        return importlib.import_module("dp_accounting")
    except ImportError as error:
        raise ImportError(
            "Privacy accounting needs the dp-accounting package: "
            'pip install "keras-gradtrack[privacy]"'
        ) from error


@contextlib.contextmanager
def orders_left_out_quietly() -> Iterator[None]:
    """Drops dp-accounting's warning, one per Rényi order, that an order's series did not
    converge (small orders at large sampling rates: 7 lines for sigma 1 at q = 0.25). The order is
    left out and epsilon is the minimum over the others: still a valid bound."""

    def keep(record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def check_arguments(
    sampling_rate: Any, steps: Any, delta: Any, accountant: Any, noise_multiplier: Any = 1.0
) -> None:
    if not isinstance(sampling_rate, (int, float)) or not 0 < sampling_rate <= 1:
        raise ValueError(
            f"Expected sampling_rate in (0, 1]. Received: sampling_rate={sampling_rate!r}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"Expected steps to be an integer >= 0. Received: steps={steps!r}")
    if not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"Expected delta in (0, 1). Received: delta={delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"Expected accountant in {ACCOUNTANTS}. Received: accountant={accountant!r}"
        )
    if not isinstance(noise_multiplier, (int, float)) or noise_multiplier < 0:
        raise ValueError(
            f"Expected noise_multiplier >= 0. Received: noise_multiplier={noise_multiplier!r}"
        )


def dp_sgd_event(noise_multiplier: float, sampling_rate: float, steps: int) -> Any:
    """The `dp_accounting` event of `steps` Poisson-sampled Gaussian steps."""
    dpa = dp_accounting()
    step = dpa.PoissonSampledDpEvent(sampling_rate, dpa.GaussianDpEvent(noise_multiplier))
    return dpa.SelfComposedDpEvent(step, steps)


def fresh_accountant(accountant: str) -> Any:
    dpa = dp_accounting()
    return dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()


def compute_epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon of `steps` DP-SGD steps at `delta` (Poisson sampling with `sampling_rate`).

    Args:
        noise_multiplier: `sigma`, the noise's standard deviation over the clipping bound.
        sampling_rate: `q`, each example's probability to be in a step's batch
            (expected batch size over dataset size).
        steps: The number of steps taken.
        delta: The target delta (commonly below 1 / dataset size).
        accountant: `"rdp"` (Rényi DP, as TensorFlow Privacy and Opacus by
            default) or `"pld"` (privacy loss distributions: tighter, slower).

    Returns:
        Epsilon (infinity without noise; 0 after no step).

    Example:

    ```python
    # TensorFlow Privacy's MNIST tutorial: 60 epochs of 60000 examples, batches of 256
    compute_epsilon(1.12, 256 / 60000, 60 * 60000 // 256, 1e-5)   # 2.52
    ```
    """
    check_arguments(sampling_rate, steps, delta, accountant, noise_multiplier)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return float("inf")
    found = fresh_accountant(accountant)
    with orders_left_out_quietly():
        found.compose(dp_sgd_event(noise_multiplier, sampling_rate, steps))
        return float(found.get_epsilon(delta))


class EpsilonCurve:
    """Epsilon after any number of steps of one `(sigma, q)`, cheap to ask step by step.

    RDP composes additively: `n` steps have `n` times one step's RDP curve, so each
    `epsilon(n)` is one conversion of a scaled curve (about 0.1 ms), equal to
    `compute_epsilon`'s result. PLD has no such shortcut: each call composes anew
    (about 0.5 s for any step count on a 2-core CPU).

    Example:

    ```python
    curve = EpsilonCurve(1.1, 0.01, 1e-5)
    [curve.epsilon(n) for n in (100, 200, 300)]
    ```
    """

    def __init__(
        self, noise_multiplier: float, sampling_rate: float, delta: float, accountant: str = "rdp"
    ) -> None:
        check_arguments(sampling_rate, 0, delta, accountant, noise_multiplier)
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.accountant = accountant
        self.known: dict[int, float] = {}
        self.one_step_rdp = None
        if accountant == "rdp" and noise_multiplier > 0:
            found = fresh_accountant("rdp")
            with orders_left_out_quietly():
                found.compose(dp_sgd_event(noise_multiplier, sampling_rate, 1))
            self.one_step_rdp = (found.orders, found.rdp)

    def epsilon(self, steps: int) -> float:
        """Epsilon at `delta` after `steps` steps (infinity without noise, 0 before any)."""
        if steps in self.known:
            return self.known[steps]
        if self.one_step_rdp is None or steps == 0 or self.noise_multiplier == 0:
            found = compute_epsilon(
                self.noise_multiplier, self.sampling_rate, steps, self.delta, self.accountant
            )
        else:
            orders, rdp = self.one_step_rdp
            found = float(dp_accounting().rdp.compute_epsilon(orders, steps * rdp, self.delta)[0])
        # The last answer, asked again at an epoch's end, training's end and the log's close.
        self.known = {steps: found}
        return found


def history_event(phases: Sequence[PrivacyPhase]) -> Any:
    """The `dp_accounting` event of a history: one DP-SGD event per phase, composed."""
    dpa = dp_accounting()
    events = []
    for phase in phases:
        if phase.sampling_rate is None:
            raise ValueError(
                "Expected every phase to have a sampling rate (pass `sampling_rate=` or "
                f"`dataset_size=` to `make_private`). Received: {phase}"
            )
        if phase.steps:
            events.append(dp_sgd_event(phase.noise_multiplier, phase.sampling_rate, phase.steps))
    return dpa.ComposedDpEvent(events)


def history_epsilon(phases: Sequence[PrivacyPhase], delta: float, accountant: str = "rdp") -> float:
    """Epsilon at `delta` of every phase of a privacy history, composed.

    Args:
        phases: `(sigma, q, steps)` phases (`model.privacy_history`), each with a
            known sampling rate.
        delta: The target delta.
        accountant: `"rdp"` or `"pld"`.

    Returns:
        Epsilon (infinity if a phase with steps has no noise; 0 without any step).

    Example:

    ```python
    phases = [PrivacyPhase(1.1, 0.01, 500, "poisson"), PrivacyPhase(2.0, 0.01, 300, "poisson")]
    history_epsilon(phases, 1e-5)
    ```
    """
    history_event(phases)  # refuses a phase without a sampling rate
    for phase in phases:
        check_arguments(phase.sampling_rate, phase.steps, delta, accountant, phase.noise_multiplier)
    spent = [phase for phase in phases if phase.steps]
    if not spent:
        return 0.0
    if any(phase.noise_multiplier == 0 for phase in spent):
        return float("inf")
    found = fresh_accountant(accountant)
    found.compose(history_event(spent))
    with orders_left_out_quietly():
        return float(found.get_epsilon(delta))


def compute_noise_multiplier(
    target_epsilon: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
    prior: Sequence[PrivacyPhase] = (),
) -> float:
    """The smallest noise multiplier whose `steps` steps spend at most `target_epsilon`.

    With `prior` phases (privacy already spent, `model.privacy_history`), the
    epsilon of those phases and the new steps together stays within the target.
    Found by `dp_accounting.calibrate_dp_mechanism` (a bracketed search, to within
    one part in a thousand, on the safe side).

    Raises:
        ValueError: Where the prior phases alone already spend the target.

    Example:

    ```python
    sigma = compute_noise_multiplier(3.0, 256 / 60000, 60 * 60000 // 256, 1e-5)
    model.make_private(l2_norm_clip=1.0, noise_multiplier=sigma)
    ```
    """
    check_arguments(sampling_rate, steps, delta, accountant)
    if not isinstance(target_epsilon, (int, float)) or target_epsilon <= 0:
        raise ValueError(
            f"Expected target_epsilon > 0. Received: target_epsilon={target_epsilon!r}"
        )
    prior = [phase for phase in prior if phase.steps]
    spent = history_epsilon(prior, delta, accountant)
    if spent >= target_epsilon:
        raise ValueError(
            f"The privacy already spent, epsilon={spent:.4g} at delta={delta}, reaches "
            f"target_epsilon={target_epsilon}: no noise keeps further steps within it. "
            f"Received history: {prior}"
        )
    if steps == 0:
        return 0.0
    dpa = dp_accounting()

    def event(sigma: float) -> Any:
        phases = [*prior, PrivacyPhase(sigma, sampling_rate, steps)]
        return history_event(phases)

    with orders_left_out_quietly():
        return float(
            dpa.calibrate_dp_mechanism(
                lambda: fresh_accountant(accountant),
                event,
                target_epsilon,
                delta,
                dpa.LowerEndpointAndGuess(1e-3, 1.0),
                tol=1e-3,
            )
        )

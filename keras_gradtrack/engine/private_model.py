"""`PrivateTraining`: `make_private` and a private model's history, budget and saving.

What every backend's `GradientTrackingMixin` shares of private training: the
arguments checked and the phase started (`make_private`), the
settings, the history and its epsilon, and the settings and history in the
model's saved compile config. Plain Python and Keras: each engine supplies the
private step itself (TensorFlow: `engine/clipping.py`; JAX:
`backends/jax/private_step.py`) and, through a hook, what it keeps for a new
phase.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from keras_gradtrack.engine import private_settings, private_training
from keras_gradtrack.privacy.adaptive_clip import AdaptiveClip
from keras_gradtrack.privacy.history import PrivacyPhase, phases_from

# The compile config's entry holding the privacy settings (`get_compile_config`).
PRIVACY_CONFIG_KEY = "keras_gradtrack_privacy"


class PrivateTraining:
    """`make_private`, `privacy_settings`, `privacy_history`, `private_steps`,
    `epsilon`, and the saved settings, for a `GradientTrackingMixin` of any backend.

    Example:

    ```python
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.01)
    model.fit(x, y, batch_size=len(x) // 100)
    model.epsilon(1e-5)
    ```
    """

    train_function: Any  # Keras' compiled train step (`Trainer.make_train_function`)

    def make_private(
        self,
        l2_norm_clip: float | dict[str, float],
        noise_multiplier: float | None = None,
        expected_batch_size: float | None = None,
        groups: dict[str, Sequence[Any]] | None = None,
        *,
        sampling_rate: float | None = None,
        dataset_size: int | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        epochs: float | None = None,
        accountant: str = "rdp",
        accumulation_steps: int | None = None,
        secure_noise: bool = False,
        adaptive_clip: AdaptiveClip | None = None,
    ) -> None:
        """Makes every following training step a DP-SGD step, on the compiled optimizer.

        Each step's optimizer receives `(sum_i min(1, C / ||g_i||) g_i + N(0, sigma^2
        C^2 I)) / B_expected` (plus the gradient of weight regularizers, which does
        not depend on the data) and applies its own update (SGD, Adam, ...). The
        clipped sum comes from the step's one backward pass (see
        `docs/privacy.md`). Every step of `fit` is then private, with or without a
        gradient logger; the example-independence guard runs before the first one.
        Each call starts a phase of `model.privacy_history` and keeps the phases
        before it; `model.epsilon(delta)` composes them all.

        Args:
            l2_norm_clip: `C`, the bound on each example's gradient norm over all
                tracked layers; or `{group name: C_k}`, one bound per group of
                `groups` (without `groups`: one per tracked layer, keyed by the
                names of `tracked_layer_names`). The noise then has standard
                deviation `sigma sqrt(sum_k C_k^2)`.
            noise_multiplier: `sigma`, the noise's standard deviation over the
                bound (0: clipping without noise, which is not private). None:
                the smallest that keeps `target_epsilon` (printed).
            expected_batch_size: `B_expected`, the divisor of the noisy sum (of a
                logical batch); default `sampling_rate * dataset_size` where both
                are given, else each step's own batch size (times `k`).
            groups: `{group name: [layers or layer names]}`: each example's
                gradient restricted to a group's layers is clipped to the group's
                bound (a float `l2_norm_clip`: the same for every group). A
                member is a tracked layer, or a layer holding tracked layers
                (all of them); every tracked layer must be in exactly one group.
            sampling_rate: `q`, each example's probability to be in a (logical)
                batch, drawn by Poisson sampling (`privacy.poisson_batches`).
            dataset_size: `N`, the training examples. Alone: shuffled batches of a
                fixed size, `q = k * batch / N` taken from `fit`'s batches (accounted
                as if Poisson-sampled: an approximation, not a guarantee).
            target_epsilon: A budget: no step takes the model's epsilon at `delta`
                (all phases composed) past it; `fit` stops with a warning before
                such a step. Without `noise_multiplier`, sigma is computed to keep
                `epochs` epochs (`ceil(epochs / q)` steps) within it.
            delta: The budget's delta.
            epochs: The planned epochs, for `target_epsilon` without `noise_multiplier`.
            accountant: The budget's accountant, `"rdp"` or `"pld"`.
            accumulation_steps: `k`: the clipped sums of `k` physical batches are
                added and noised once, as one logical batch (one optimizer update,
                one step of the accountant at the logical batch's rate); through
                the optimizer's `gradient_accumulation_steps`.
            secure_noise: Draw the noise in float64 from the operating system's
                cryptographically secure generator (Opacus' `secure_mode`: a sum
                of 4 Box-Muller draws on 53-bit uniforms), not seeded, so that it
                resists the floating-point attacks on the default float32 draw
                (`docs/privacy.md`, "The noise"). Slower; not with XLA.
            adaptive_clip: A `keras_gradtrack.privacy.AdaptiveClip`: the bound
                starts at `l2_norm_clip` and moves each step toward a quantile of
                the per-example norms (Andrew et al. 2021), with the noise
                multiplier shared so that the total is still `noise_multiplier`'s.

        Raises:
            ValueError: On invalid arguments (a layer in two groups or in none, a
                name that is no layer), an uncompiled model, or a model that
                cannot train privately (BatchNormalization in training mode).

        Example:

        ```python
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1)
        model.fit(x, y, batch_size=256, epochs=60)

        # A bound per group of layers:
        model.make_private(
            l2_norm_clip={"encoder": 1.0, "head": 0.5},
            groups={"encoder": [model.get_layer("encoder")], "head": ["classifier"]},
            noise_multiplier=1.1,
        )

        # Sigma for epsilon 3 over 10 epochs, logical batches of 4 x 256:
        model.make_private(l2_norm_clip=1.0, target_epsilon=3.0, delta=1e-5, epochs=10,
                           dataset_size=len(x), expected_batch_size=1024,
                           accumulation_steps=4)
        model.fit(x, y, batch_size=256, epochs=10)
        ```
        """
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError(
                "Expected noise_multiplier, or target_epsilon (with delta and epochs) to "
                "compute it. Received neither."
            )
        rate, n, expected, sampling = private_training.rate_and_sampling(
            sampling_rate, dataset_size, expected_batch_size
        )
        settings = private_settings.validated_settings(
            self,
            l2_norm_clip,
            0.0 if noise_multiplier is None else noise_multiplier,
            expected,
            groups,
            secure_noise,
            adaptive_clip,
        )
        found_budget = private_training.checked_budget(target_epsilon, delta, accountant)
        k = private_training.checked_accumulation_steps(self, accumulation_steps)
        if k > 1 and settings.adaptive_clip is not None:
            raise ValueError(
                "Adaptive clipping updates its bound after every optimizer step; with "
                "logical batches the physical batches of one logical batch would be "
                f"clipped to different bounds. Received: accumulation_steps={k} with "
                f"adaptive_clip={settings.adaptive_clip!r}"
            )
        settings = dataclasses.replace(
            settings,
            noise_multiplier=math.nan if noise_multiplier is None else settings.noise_multiplier,
            sampling_rate=rate,
            dataset_size=n,
            sampling=sampling,
            accumulation_steps=k,
            budget=found_budget,
        )
        private_training.start_phase(self, settings, target_epsilon, epochs)
        self._started_private_phase()
        self.train_function = None  # traced anew: every step takes the private path

    @property
    def privacy_settings(self) -> private_settings.PrivacySettings | None:
        """The settings of `make_private`, or None when the model trains without privacy."""
        return private_settings.settings_of(self)

    @property
    def private_steps(self) -> int:
        """Private steps (optimizer updates) of every phase of `privacy_history`."""
        return sum(phase.steps for phase in self.privacy_history)

    @property
    def privacy_history(self) -> tuple[PrivacyPhase, ...]:
        """Every phase of private training, `(sigma, q, steps, sampling)`, the current last.

        Example:

        ```python
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.01)
        model.fit(...)
        model.make_private(l2_norm_clip=1.0, noise_multiplier=2.0, sampling_rate=0.01)
        model.fit(...)
        [phase.steps for phase in model.privacy_history]   # [steps of each fit]
        ```
        """
        return private_training.history(self)

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """Epsilon at `delta` of every phase of `privacy_history`, composed.

        Example:

        ```python
        model.epsilon(1e-5)                    # RDP
        model.epsilon(1e-5, accountant="pld")  # tighter
        ```
        """
        return private_training.epsilon(self, delta, accountant)

    def get_compile_config(self) -> Any:
        """Keras' compile config, with the settings of `make_private` and the privacy
        history: a private model saved with `save("m.keras")` loads private."""
        config = super().get_compile_config()  # type: ignore[misc]
        privacy = private_settings.config_of(self)
        if config and privacy is not None:
            history = [phase.as_dict() for phase in self.privacy_history]
            config = {**config, PRIVACY_CONFIG_KEY: {**privacy, "history": history}}
        return config

    def compile_from_config(self, config: Any) -> None:
        """Compiles as Keras does, then makes the model private again with the saved
        settings (a fresh noise seed, as `make_private` draws) and steps taken."""
        config = dict(config)
        privacy = config.pop(PRIVACY_CONFIG_KEY, None)
        super().compile_from_config(config)  # type: ignore[misc]
        if privacy is None or getattr(self, "optimizer", None) is None:
            return  # not compiled: Keras warned of a custom `compile`
        privacy = dict(privacy)
        steps = int(privacy.pop("steps", 0))  # files saved before the history
        history = privacy.pop("history", None)
        self.make_private(**privacy)
        if history is None:
            private_training.record_steps(self, steps)
        else:
            private_training.set_history(self, phases_from(history))

    def _started_private_phase(self) -> None:
        """What the backend keeps for the phase `make_private` started (the adaptive
        bound's variable)."""

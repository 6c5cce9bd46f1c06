"""The one-run privacy audit (`privacy/audit.py`) run on the library's own private step.

Canary `j` is the input `c e_j` (a one-hot of norm `c`) of a Dense layer without bias
and with a loss linear in its output, so its per-example gradient is `-c e_j`, a Dirac
of norm `c` on kernel weight `j`; the score of canary `j` is the change of that weight.
It trains a model, so it stands above `models` (an entry point, as the demo does), on
the backend Keras runs on: TensorFlow's private step, JAX's or PyTorch's (`KERAS_BACKEND`).
`clipping_off` is the audit's control, a broken step that the audit must catch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

import keras_gradtrack
from keras_gradtrack._patching import patched
from keras_gradtrack.engine import clip_weights as shared_clipping
from keras_gradtrack.privacy.audit import AuditResult, audit_scores


def dirac_canary_audit(
    canaries: int,
    noise_multiplier: float,
    steps: int,
    guesses_per_side: int,
    l2_norm_clip: float = 1.0,
    canary_norm: float = 1.0,
    delta: float = 1e-5,
    seed: int = 0,
    **make_private: Any,
) -> AuditResult:
    """Trains a private Dense layer on Dirac canaries and audits it (module docstring).

    Each canary is included with probability 1/2 (numpy, `seed`); every step is a full
    batch of the included canaries (sampling rate 1, `expected_batch_size` half the
    canaries), SGD at learning rate 1, for `steps` steps from zero weights, through
    `make_private`'s private step. The accountant's epsilon of the same run is
    `compute_epsilon(noise_multiplier, 1.0, steps, delta)`.

    Args:
        canaries: `m`, the number of canaries (the layer's input size).
        noise_multiplier: `sigma` of `make_private`.
        steps: Training steps.
        guesses_per_side: Canaries guessed "in" (and as many "out").
        l2_norm_clip: `C` of `make_private`.
        canary_norm: Each canary's gradient norm (above `C`: clipped to `C`).
        delta: The delta of the bound.
        seed: Seeds the inclusions and Keras (the default noise).
        **make_private: More arguments of `make_private` (`secure_noise=True`).

    Example:

    ```python
    result = dirac_canary_audit(1000, noise_multiplier=3.0, steps=4, guesses_per_side=100)
    result.epsilon_lower_bound   # below compute_epsilon(3.0, 1.0, 4, 1e-5) = 2.98
    ```
    """
    included = np.random.default_rng(seed).random(canaries) < 0.5
    x = canary_norm * np.eye(canaries, dtype=np.float32)[included]
    y = np.ones((len(x), 1), np.float32)
    keras.utils.set_random_seed(seed)
    # The engine of the backend Keras runs on (TensorFlow's or JAX's).
    model = keras_gradtrack.GradientTrackingSequential(
        [
            keras.Input((canaries,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=linear_loss)
    model.make_private(
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=canaries / 2,
        **make_private,
    )
    model.fit(x, y, batch_size=max(len(x), 1), epochs=steps, shuffle=False, verbose=0)
    # Each canary's loss gradient is -c e_j: SGD moves weight j up when it is in.
    scores = model.trainable_variables[0].numpy()[:, 0]
    return audit_scores(scores, included, guesses_per_side, delta)


def linear_loss(y_true: Any, y_pred: Any) -> Any:
    """`-<y_true, y_pred>` per example: its gradient at the output is `-y_true`."""
    return -keras.ops.sum(y_true * y_pred, axis=-1)


@contextlib.contextmanager
def clipping_off() -> Iterator[None]:
    """The audit's control: within the block, the private step of any backend
    weighs every example 1 (no clipping), while the noise keeps the claimed `sigma C`.

    Every engine looks up `engine/clip_weights.py`'s `clip_weights` when its step is
    run (TensorFlow: `engine/clipping.py`; JAX, PyTorch: their `private_step.py`):
    the block replaces it there with `unclipped_weights`. Never train for real in it.

    Example:

    ```python
    with clipping_off():
        result = dirac_canary_audit(1000, 3.0, 4, 100, canary_norm=100.0)
    result.epsilon_lower_bound   # far above compute_epsilon(3.0, 1.0, 4, 1e-5)
    ```
    """
    with patched(shared_clipping, "clip_weights", unclipped_weights):
        yield


def unclipped_weights(
    settings: Any, model: Any, plan: Any, sq_norms: Any, bound: Any = None
) -> tuple[list[Any], Any]:
    """`clip_weights.clip_weights`'s signature with every weight 1 and none clipped."""
    ones = keras.ops.ones_like(sq_norms[0])
    return [ones] * len(plan), keras.ops.zeros_like(sq_norms[0], dtype="bool")

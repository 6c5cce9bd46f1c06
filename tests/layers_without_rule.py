"""A layer no rule covers, for the tests of the exact per-layer fallback.

Keras' own layers may get rules at any time (PReLU did); this one never will.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


class NoRule(keras.layers.Layer):
    """`y = max(x, 0) + alpha * min(x, 0)`, one `alpha` per input value (as PReLU)."""

    def __init__(self, alpha_initializer: Any = "zeros", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.alpha_initializer = keras.initializers.get(alpha_initializer)

    def build(self, input_shape: Any) -> None:
        self.alpha = self.add_weight(
            shape=tuple(input_shape[1:]), initializer=self.alpha_initializer, name="alpha"
        )

    def call(self, x: Any) -> Any:
        return ops.relu(x) - self.alpha * ops.relu(-x)

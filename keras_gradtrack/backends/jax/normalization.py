"""The JAX engine's rules for LayerNormalization, RMSNormalization and GroupNormalization.

Each computes `y = n(x) * scale + offset`, `n(x)` normalized within one example, so
example i's parameter gradients are `sum d_i * n(x_i)` and `sum d_i` over the axes
the parameters do not span: as small as the parameters, built directly. `n(x)` is
recomputed from the probed input as the layer computes it (its axes, epsilon and
variant), by `keras_gradtrack.rule_math` in `keras.ops`.

Example:

```python
# x: (B, T, C), LayerNormalization(axis=-1)  =>  g_i(gamma) = sum_t d_it * n(x_it)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras

from keras_gradtrack import rule_math
from keras_gradtrack.backends.jax.rules import JaxRule, ProbedCall

# (layer, the input, its normalized axes, epsilon) -> n(x)
Normalize = Callable[[Any, Any, Sequence[int], float], Any]


def built_rank(layer: Any) -> int | None:
    """The rank of the input the layer was built for, if Keras recorded it."""
    shape = (layer.get_build_config() or {}).get("input_shape")
    return len(shape) if isinstance(shape, (list, tuple)) else None


def axes_of(layer: Any) -> list[int]:
    return [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)


def excludes_batch_axis(layer: Any) -> bool:
    """False when the layer's `axis` is (or may be) the batch axis of its input."""
    rank = built_rank(layer)
    if rank is None:
        return all(a != 0 for a in axes_of(layer))
    return all(a % rank != 0 for a in axes_of(layer))


def trailing_axes(layer: Any) -> bool:
    """RMSNormalization's `scale` broadcasts against the input's trailing axes, whatever
    `axis` says: the rule covers it where `axis` is those trailing axes."""
    axes, rank = axes_of(layer), built_rank(layer)
    if rank is None:
        return sorted(axes) == list(range(-len(axes), 0))
    resolved = sorted(a % rank for a in axes)
    return 0 not in resolved and resolved == list(range(rank - len(resolved), rank))


def epsilon_of(layer: Any) -> float:
    return keras.config.epsilon() if layer.epsilon is None else layer.epsilon


def layer_normalized(layer: Any, x: Any, axes: Sequence[int], epsilon: float) -> Any:
    if layer.rms_scaling:  # the deprecated option divides by the standard deviation
        return rule_math.variance_scaled(x, axes, epsilon)
    return rule_math.centered_normalized(x, axes, epsilon)


def rms_normalized(layer: Any, x: Any, axes: Sequence[int], epsilon: float) -> Any:
    return rule_math.rms_scaled(x, axes, epsilon)


def group_normalized(layer: Any, x: Any, axes: Sequence[int], epsilon: float) -> Any:
    (axis,) = axes
    return rule_math.group_normalized(x, axis, layer.groups, epsilon)


def normalization_rule(
    name: str,
    normalize: Normalize,
    scale: str,
    offset: str | None,
    applies: Callable[[Any], bool],
) -> JaxRule:
    """A rule for `y = normalize(x) * <scale> + <offset>` (variables named `scale` and
    `offset`; either may be absent or frozen)."""

    def per_example(
        layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
    ) -> list[Any]:
        x = call.inputs
        rank = len(x.shape)
        axes = sorted(a % rank for a in axes_of(layer))
        grads = {}
        for variable in layer.trainable_variables:
            if variable.name == scale:
                normalized = normalize(layer, x, axes, epsilon_of(layer))
                grads[variable.name] = rule_math.affine_per_example(
                    call.output_grad, normalized, axes
                )
            elif variable.name == offset:
                grads[variable.name] = rule_math.affine_per_example(call.output_grad, None, axes)
        return [grads[v.name] for v in layer.trainable_variables]

    return JaxRule(name, per_example, applies=applies)


LAYER_NORMALIZATION = normalization_rule(
    "layer_normalization", layer_normalized, "gamma", "beta", excludes_batch_axis
)
RMS_NORMALIZATION = normalization_rule(
    "rms_normalization", rms_normalized, "scale", None, trailing_axes
)
GROUP_NORMALIZATION = normalization_rule(
    "group_normalization", group_normalized, "gamma", "beta", excludes_batch_axis
)

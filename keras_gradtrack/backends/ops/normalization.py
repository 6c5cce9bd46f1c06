"""Rules over `keras.ops` for LayerNormalization, RMSNormalization and GroupNormalization.

Each computes `y = n(x) * scale + offset`, `n(x)` normalized within one example, so
example i's parameter gradients are `sum d_i * n(x_i)` and `sum d_i` over the axes
the parameters do not span: as small as the parameters, built directly. `n(x)` is
recomputed from the probed input as the layer computes it (its axes, epsilon and
variant), by `keras_gradtrack.rule_math` in `keras.ops`, the TensorFlow engine's math
too; GroupNormalization's from its moments, constant per group and channel.

Example:

```python
# x: (B, T, C), LayerNormalization(axis=-1)  =>  g_i(gamma) = sum_t d_it * n(x_it)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from keras_gradtrack import rule_math
from keras_gradtrack.backends.ops.rules import ProbedCall, ProbedRule

# (layer, the input, the axes the scale spans, the output gradient) -> the scale's
# per-example gradient.
ScaleGradient = Callable[[Any, Any, Sequence[int], Any], Any]


def axes_of(layer: Any, rank: int) -> list[int]:
    return sorted(a % rank for a in rule_math.axes_list(layer.axis))


def excludes_batch_axis(layer: Any) -> bool:
    return rule_math.excludes_batch_axis(layer, layer.axis)


def scale_of_normalized(normalize: Callable[[Any, Any, Sequence[int]], Any]) -> ScaleGradient:
    """`sum d_i n(x_i)` with `n(x) = normalize(layer, x, axes)` built as large as the input."""

    def scale_gradient(layer: Any, x: Any, axes: Sequence[int], d: Any) -> Any:
        return rule_math.affine_per_example(d, normalize(layer, x, axes), axes)

    return scale_gradient


def group_scale_gradient(layer: Any, x: Any, axes: Sequence[int], d: Any) -> Any:
    """GroupNormalization's `sum d_i n(x_i)` from its moments, constant per group and
    channel: `rule_math.scale_from_moments`, no `n(x)` as large as the input."""
    (axis,) = axes
    grouped = rule_math.in_groups(rule_math.f32(x), axis, layer.groups)
    mean, inverse = rule_math.group_moments(grouped, axis, rule_math.epsilon_of(layer))
    return rule_math.scale_from_moments(x, d, mean, inverse, axes)


def normalization_rule(
    name: str,
    scale_gradient: ScaleGradient,
    scale: str,
    offset: str | None,
    applies: Callable[[Any], bool],
) -> ProbedRule:
    """A rule for `y = n(x) * <scale> + <offset>` (variables named `scale` and `offset`;
    either may be absent or frozen), `scale_gradient` giving the scale's."""

    def per_example(
        layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
    ) -> list[Any]:
        x = call.inputs
        axes = axes_of(layer, len(x.shape))
        grads = {}
        for variable in layer.trainable_variables:
            if variable.name == scale:
                grads[variable.name] = scale_gradient(layer, x, axes, call.output_grad)
            elif variable.name == offset:
                grads[variable.name] = rule_math.affine_per_example(call.output_grad, None, axes)
        return [grads[v.name] for v in layer.trainable_variables]

    return ProbedRule(name, per_example, applies=applies)


LAYER_NORMALIZATION = normalization_rule(
    "layer_normalization",
    scale_of_normalized(rule_math.layer_normalized),
    "gamma",
    "beta",
    excludes_batch_axis,
)
RMS_NORMALIZATION = normalization_rule(
    "rms_normalization",
    scale_of_normalized(rule_math.rms_normalized),
    "scale",
    None,
    rule_math.spans_trailing_axes,
)
GROUP_NORMALIZATION = normalization_rule(
    "group_normalization", group_scale_gradient, "gamma", "beta", excludes_batch_axis
)

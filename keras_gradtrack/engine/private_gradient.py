"""What a private step hands the optimizer, from its clipped sums: written once.

Every backend's private step (TensorFlow's `engine/clipping.py`, the probed engines'
`backends/ops/private_step.py`) ends the same way. Per trainable variable, in the
optimizer's scale (`s`, the loss scale, which the optimizer divides out):

    s (sum_i w_i g_i + N(0, sigma^2 C^2 I)) / divisor  +  s * (the penalties' gradient)

in one pass over the variable: `sum * a + z * b`, the noise's factor `b` handed to
the backend's draw (which applies it to the draw's radii, half its size, before they
are multiplied out). The draws are asked for in the order of the variables, position
`p` for the `p`-th (TensorFlow and PyTorch seed each from its position, JAX slices
one draw for all of them at its offset: the same noise on every backend for the same
seed is not promised, the same order and scale is). The divisor is
`clip_weights.step_divisor`'s.

Example:

```python
gradients = noised_gradients(model.trainable_variables, sums, draw, s * sigma * C / B, s / B)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from keras import ops

# `(position, shape, scale) -> scale * N(0, I)` of `shape`, for trainable variable
# `position` (`len(trainable)`: the adaptive bound's count of unclipped examples).
Draw = Callable[[int, tuple[int, ...], Any], Any]


def noised_gradients(
    variables: Sequence[Any],
    sums: dict[int, Any],
    draw: Draw | None,
    noise_factor: Any,
    sums_factor: Any,
    penalties: Sequence[Any | None] | None = None,
) -> list[Any]:
    """What the optimizer receives, aligned with `variables` (the trainable variables,
    or the step's sources): each clipped sum (`sums`, by `id(variable)`) times
    `sums_factor`, plus `draw(position, shape, noise_factor)` (none where `draw` is
    None), plus the penalties' gradient (per position, in the optimizer's scale, None
    where a variable has none), in each variable's dtype.

    Raises:
        ValueError: A variable in no tracked layer (nothing clips it).
    """
    gradients = []
    for position, variable in enumerate(variables):
        if id(variable) not in sums:
            raise ValueError(
                "A private step needs every trainable variable to belong to a tracked "
                f"layer. Received: {getattr(variable, 'path', variable)!r}"
            )
        gradient = sums[id(variable)] * sums_factor
        shape = tuple(variable.shape)
        if draw is not None:
            gradient = gradient + draw(position, shape, noise_factor)
        if penalties is not None and penalties[position] is not None:
            gradient = gradient + ops.reshape(ops.cast(penalties[position], "float32"), shape)
        gradients.append(ops.cast(gradient, variable.dtype))
    return gradients

"""Rule for ConvNeXt's LayerScale (`keras.applications.convnext`): `y = x * gamma`.

`gamma` spans the last axis and broadcasts over the others, so with `d_i` the
gradient at example i's output, `g_i(gamma) = sum_pos x_i * d_i`: as small as
`gamma`, materialized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_gradtrack import rule_math
from keras_gradtrack.rules.contract import LayerCall, Rule


def layer_scale_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of LayerScale's `gamma`.

    Example:

    ```python
    # x: (B, H, W, C)  =>  g_i(gamma) = sum_{h,w} x_ihw * d_ihw   (C,)
    ```
    """
    grads = [rule_math.layer_scale_gradients(call.inputs, call.output_grad) for call in calls]
    return [(layer.gamma, rule_math.total(grads))]


LAYER_SCALE = Rule.from_per_example("layer_scale", layer_scale_per_example)

"""The opt-in statistics on JAX: Gram matrices (`pairwise_cosine`) and input gradients
(`input_grad_norm`), from the tracked step's one `jax.value_and_grad`.

* **Gram matrices.** Per tracked layer, `<g_i, g_j>` from the same rules as the other
  statistics: a rule's factored form where it has one (Dense on 2-D inputs:
  `(a_i . a_j + 1) (d_i . d_j)`, `rule_math.dense_cross`, the TensorFlow engine's
  too), else `g g^T` of the layer's per-example gradients (its rule's or the exact
  per-layer fallback's, summed over its calls; `rule_math.per_example_gram`).
* **Input gradients.** A zero probe is added to each float input the model receives
  (the first argument of its `call`), and the step differentiates with respect to
  these probes too: a probe's gradient is `c d l_i / d x_i` per example (no example's
  input reaches another's loss).

Example:

```python
inputs = InputProbes(model, enabled=True)
with inputs.installed(None):          # a first trace records the probed shapes
    model(x)
shapes = [x.shape for x in inputs.probed]
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_gradtrack._patching import patched
from keras_gradtrack.statistics import Statistic


def needs_gram(statistics: Sequence[Statistic]) -> bool:
    return any(statistic.needs_gram for statistic in statistics)


def needs_input_gradients(statistics: Sequence[Statistic]) -> bool:
    return any(statistic.needs_input_gradients for statistic in statistics)


class InputProbes:
    """Zero probes on the float inputs of the model's `call`, while installed.

    Args:
        model: The model whose inputs are probed.
        enabled: Whether to probe (False: `installed` changes nothing, `probed` stays
            empty).
    """

    def __init__(self, model: keras.Model, enabled: bool):
        self.model = model
        self.enabled = enabled
        self.probed: list[Any] = []

    @contextlib.contextmanager
    def installed(self, probes: Sequence[Any] | None) -> Iterator[InputProbes]:
        """The probes on the model's call for the block (None: nothing added, the
        probed inputs recorded, for their shapes)."""
        self.probed = []
        if not self.enabled:
            yield self
            return
        with patched(self.model, "call", self._probing_call(self.model.call, probes)):
            yield self
        if not self.probed:
            raise ValueError(
                f"input_grad_norm probes the inputs of model {self.model.name!r}'s call, and "
                "the differentiated function did not call the model: differentiate a "
                "function that runs it (`self.stateless_call` or "
                "`self.compute_loss_and_updates`)."
            )

    def _probing_call(self, original: Callable[..., Any], probes: Any) -> Callable[..., Any]:
        def probing_call(*args: Any, **kwargs: Any) -> Any:
            if self.probed:
                raise ValueError(
                    f"Model {self.model.name!r} was called more than once in the step, so "
                    "the gradient at its inputs is not one example's d l_i / d x_i. "
                    "Expected statistics without input gradients. Received: input_grad_norm"
                )
            if not args:
                raise ValueError(
                    f"Model {self.model.name!r} was called without a positional input: "
                    "input_grad_norm probes the model's first argument."
                )
            leaves, structure = jax.tree_util.tree_flatten(args[0])
            floats = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
            if not floats:
                raise ValueError(
                    "input_grad_norm needs float inputs: the gradient with respect to "
                    "integer inputs (such as token ids) is not defined. Received input "
                    f"dtypes: {[jnp.dtype(leaf.dtype).name for leaf in leaves]}"
                )
            for position, i in enumerate(floats):
                self.probed.append(leaves[i])
                if probes is not None:
                    leaves[i] = leaves[i] + probes[position].astype(leaves[i].dtype)
            return original(jax.tree_util.tree_unflatten(structure, leaves), *args[1:], **kwargs)

        return probing_call


def is_float(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)

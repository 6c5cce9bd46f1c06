"""Every private Keras and TensorFlow name keras_gradtrack relies on, in one place.

Keras moves or renames private names between releases without notice. Each one the
package uses is reached through this module (the rest of the package imports
nothing from `keras.src` or `tensorflow.python`, and reads no `_`-prefixed
attribute of a Keras object), and `PRIVATE_NAMES` lists them all:
`tests/test_keras_seam.py` resolves each and fails naming the name and the Keras
version when one has moved. Where Keras has a public equivalent, the package uses
that instead (`keras.utils.pack_x_y_sample_weight`, calling a model with
`training=` whatever its `call` declares).

`GradientTrackingMixin.train_step` is Keras' own `TensorFlowTrainer.train_step`
with `tape.gradient` replaced; the private attributes that copy reads are listed
in `TRAINER_ATTRIBUTES`, and a test compares the copy with the installed source.
Both engines use this module (the JAX engine too): it imports no TensorFlow itself,
its two TensorFlow names are imported where they are used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import keras
from keras.src import backend as keras_backend
from keras.src.applications.convnext import LayerScale
from keras.src.backend.common.tensor_attributes import get_tensor_attr, set_tensor_attr
from keras.src.losses import loss as loss_module
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.saving import saving_lib

# The two TensorFlow-only names are imported where they are used, so that this module
# (and the loggers that read Keras objects through it) imports no TensorFlow on JAX.


def collective_all_reduce_multi_worker(strategy: Any) -> bool:
    """Whether `strategy` all-reduces across workers (Keras' own test)."""
    from keras.src.backend.tensorflow.trainer import _collective_all_reduce_multi_worker

    return bool(_collective_all_reduce_multi_worker(strategy))


def _is_mkl_enabled() -> Callable[[], Any]:
    from tensorflow.python.util import _pywrap_util_port

    return _pywrap_util_port.IsMklEnabled


# The attribute Keras attaches a tensor's mask under (`tensor_attributes`).
KERAS_MASK = "_keras_mask"


def flatten_layers(model: Any, include_self: bool = True) -> list[Any]:
    """Every layer of `model`, outer layers first (`Layer._flatten_layers`)."""
    return list(model._flatten_layers(include_self=include_self))


def own_trainable_variables(layer: Any) -> list[Any]:
    """The trainable variables `layer` created itself, not its sublayers'."""
    return list(layer._trainable_variables)


def optimizer_apply_count(optimizer: Any) -> Any:
    """The optimizer's count of `apply` calls (`iterations` counts updates: with
    `gradient_accumulation_steps`, one per accumulated batch)."""
    return optimizer._iterations


def state_sharding_spec(model: Any) -> Any:
    """The shardings of a model's state under `keras.distribution` on JAX, as Keras'
    JAX trainer gives them to its jitted train step as `out_shardings`."""
    return model._get_state_sharding_spec()


def layer_losses(layer: Any) -> list[Any]:
    """The losses `layer` added in its last call (`add_loss`, activity regularizers)."""
    return list(layer._losses)


def compiled_loss(model: Any) -> Any:
    """The `CompileLoss` of a compiled model, or None."""
    return getattr(model, "_compile_loss", None)


def compiled_loss_weights(model: Any) -> Any:
    """The `loss_weights` a model was compiled with (None without them, or uncompiled)."""
    return getattr(compiled_loss(model), "_user_loss_weights", None)


def batch_moments(layer: Any, x: Any, mask: Any) -> tuple[Any, Any]:
    """BatchNormalization's `(mean, variance)` of `x` as its call computes them."""
    return layer._moments(x, mask)


def causal_padding(layer: Any) -> Any:
    """A causal Conv1D's padding of its input, as its call pads."""
    return layer._compute_causal_padding()


def reshape_into_groups(layer: Any, x: Any) -> Any:
    """GroupNormalization's `(B, ..., groups, channels // groups)` view of `x`."""
    return layer._reshape_into_groups(x)


def is_onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN's CPU kernels in this process."""
    return bool(_is_mkl_enabled()())


def tf_variable(variable: Any) -> Any:
    """The `tf.Variable` under a Keras variable (the variable itself otherwise)."""
    return getattr(variable, "_value", variable)


def update_metrics_variables(
    model: Any,
    metrics_variables: Any,
    unscaled_loss: Any,
    x: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
) -> tuple[Any, Any]:
    """`(logs, metrics_variables)` after the step, as Keras' JAX `train_step` computes them."""
    return model._update_metrics_variables(
        metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )


def compute_loss(
    model: Any,
    x: Any = None,
    y: Any = None,
    y_pred: Any = None,
    sample_weight: Any = None,
    training: bool = True,
) -> Any:
    """`model.compute_loss` called as Keras' trainer calls it (`Trainer._compute_loss`).

    Keras passes `training` only to a `compute_loss` whose signature takes it (the
    argument came in Keras 3.3: keras-io's examples override `compute_loss(self,
    x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False)`), and
    the arguments by position; a model that overrides `_compute_loss` itself
    (`keras.distillation.Distiller`) has it called, as Keras' steps do.

    Example:

    ```python
    loss = compute_loss(model, x, y, model(x, training=False), training=False)
    ```
    """
    return model._compute_loss(x, y, y_pred, sample_weight=sample_weight, training=training)


# A `keras.Model` subclass -> its variant with `Functional` mixed in.
_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def functional_variant(cls: type, variant: type | None = None) -> type:
    """`cls` with `Functional` mixed in (same name and module, so saving finds `cls`);
    `variant` registers a class declared for it instead."""
    if variant is not None:
        _FUNCTIONAL_VARIANTS[cls] = variant
    if cls not in _FUNCTIONAL_VARIANTS:
        _FUNCTIONAL_VARIANTS[cls] = type(
            cls.__name__,
            (cls, Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _FUNCTIONAL_VARIANTS[cls]


class FunctionalWhenGivenInputs:
    """Put before `keras.Model` in a subclass's bases: constructed with inputs and
    outputs, the class builds its `functional_variant`.

    Keras makes a `Model` subclass functional by rewriting its bases in place, after
    which subclass-style construction of the same class fails; a functional variant
    of the class keeps both styles working.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            cls = functional_variant(cls)
        return super().__new__(cls)  # type: ignore[misc]


def functional_inputs(model: Any) -> Any:
    """The input structure of a functional (or Sequential's inner functional) model,
    or None."""
    functional = getattr(model, "_functional", None) or model
    return getattr(functional, "_inputs_struct", None)


def build_shapes(model: Any) -> list[Any]:
    """The input shapes a built subclassed model recorded, or `[]`."""
    return list((getattr(model, "_build_shapes_dict", None) or {}).values())


# Private attributes of `keras.Model` that `GradientTrackingMixin` reads in its copy
# of Keras' train step and in the hooks it overrides.
TRAINER_ATTRIBUTES = (
    "_call_has_training_arg",
    "_compute_loss",
    "_loss_tracker",
    "_distribute_strategy",
    "_maybe_symbolic_build",
    "_symbolic_build",
    "_flatten_layers",
    "_make_function",
)


def _probe_model() -> Any:
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(loss="mse")
    return model


def _attributes(make: Callable[[], Any], *names: str) -> Callable[[], Any]:
    def probe() -> Any:
        instance = make()
        return [getattr(instance, name) for name in names]

    return probe


def _probe_attribute(name: str) -> Callable[[], Any]:
    return _attributes(_probe_model, name)


def _masked_tensor_attribute() -> Any:
    masked = keras.layers.Masking()(keras.ops.ones((1, 2, 2)))
    mask = get_tensor_attr(masked, KERAS_MASK)
    if mask is None:
        raise AttributeError(f"Masking's output carries no {KERAS_MASK!r}")
    return mask


# Every private name above, with a probe that resolves it (what the seam's test runs).
PRIVATE_NAMES: dict[str, Callable[[], Any]] = {
    "keras.src.backend.rnn": lambda: keras_backend.rnn,
    "keras.src.backend.cudnn_ok": lambda: keras_backend.cudnn_ok,
    "keras.src.applications.convnext.LayerScale": lambda: LayerScale,
    "keras.src.backend.common.tensor_attributes.get_tensor_attr": lambda: get_tensor_attr,
    "keras.src.backend.common.tensor_attributes.set_tensor_attr": lambda: set_tensor_attr,
    "keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker": (
        lambda: (
            importlib.import_module(
                "keras.src.backend.tensorflow.trainer"
            )._collective_all_reduce_multi_worker
        )
    ),
    "keras.src.losses.loss.reduce_values": lambda: loss_module.reduce_values,
    "keras.src.losses.loss.unscale_loss_for_distribution": (
        lambda: loss_module.unscale_loss_for_distribution
    ),
    "keras.src.losses.losses.LossFunctionWrapper": lambda: LossFunctionWrapper,
    "keras.src.models.functional.Functional": lambda: Functional,
    "keras.src.models.model.functional_init_arguments": lambda: functional_init_arguments,
    "keras.src.saving.saving_lib.save_weights_only": lambda: saving_lib.save_weights_only,
    "keras.src.saving.saving_lib.load_weights_only": lambda: saving_lib.load_weights_only,
    "tensorflow.python.util._pywrap_util_port.IsMklEnabled": _is_mkl_enabled,
    "Layer._flatten_layers": _probe_attribute("_flatten_layers"),
    "Layer._trainable_variables": _probe_attribute("_trainable_variables"),
    "Layer._losses": _probe_attribute("_losses"),
    "Model._compile_loss": _probe_attribute("_compile_loss"),
    "CompileLoss._user_loss_weights": _attributes(
        lambda: compiled_loss(_probe_model()), "_user_loss_weights"
    ),
    "Functional._inputs_struct": _probe_attribute("_inputs_struct"),
    "Sequential._functional": _attributes(
        lambda: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), "_functional"
    ),
    "Model._build_shapes_dict": _attributes(lambda: keras.Model(), "_build_shapes_dict"),
    "Variable._value": _attributes(lambda: keras.Variable(1.0), "_value"),
    "Optimizer._iterations": _attributes(keras.optimizers.SGD, "_iterations"),
    "JAXTrainer._get_state_sharding_spec": lambda: (
        importlib.import_module("keras.src.backend.jax.trainer").JAXTrainer._get_state_sharding_spec
    ),
    "BatchNormalization._moments": _attributes(keras.layers.BatchNormalization, "_moments"),
    "Conv1D._compute_causal_padding": _attributes(
        lambda: keras.layers.Conv1D(1, 2, padding="causal"), "_compute_causal_padding"
    ),
    "GroupNormalization._reshape_into_groups": _attributes(
        lambda: keras.layers.GroupNormalization(1), "_reshape_into_groups"
    ),
    "tensor attribute _keras_mask": lambda: _masked_tensor_attribute(),
    "JAXTrainer._update_metrics_variables": lambda: (
        importlib.import_module(
            "keras.src.backend.jax.trainer"
        ).JAXTrainer._update_metrics_variables
    ),
    **{f"Model.{name}": _probe_attribute(name) for name in TRAINER_ATTRIBUTES},
}

"""`patched`: every swap of an attribute for a block is undone exactly, however it ends."""

from __future__ import annotations

import types
from typing import Any

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt
from keras_gradtrack._keras_seam import loss_module
from keras_gradtrack._patching import patched, patched_each


def replacement(*args: Any, **kwargs: Any) -> str:
    return "patched"


def test_a_method_of_the_class_shows_again_afterwards() -> None:
    layer = keras.layers.Dense(2)
    with patched(layer, "call", replacement) as original:
        assert layer.call() == "patched"
        assert original.__func__ is keras.layers.Dense.call
    assert "call" not in vars(layer)
    assert layer.call.__func__ is keras.layers.Dense.call


def test_an_attribute_of_the_instance_is_put_back() -> None:
    layer = keras.layers.Dense(2, activation="relu")
    activation = layer.activation
    with patched(layer, "activation", replacement):
        assert layer.activation is replacement
    assert layer.activation is activation


def test_a_property_is_restored_through_its_setter() -> None:
    layer = keras.layers.Dense(2, kernel_regularizer="l2")
    layer.build((None, 3))
    regularizer = layer.kernel.regularizer
    with patched(layer.kernel, "regularizer", replacement):
        assert layer.kernel.regularizer is replacement
    assert layer.kernel.regularizer is regularizer


def test_a_module_attribute_is_restored_even_when_the_block_raises() -> None:
    module = types.ModuleType("example")
    module.function = len
    with pytest.raises(RuntimeError), patched(module, "function", replacement):
        raise RuntimeError("inside")
    assert module.function is len


def test_patched_each_restores_all() -> None:
    layers = [keras.layers.Dense(2), keras.layers.Dense(3)]
    with patched_each((layer, "call", replacement) for layer in layers):
        assert [layer.call() for layer in layers] == ["patched", "patched"]
    assert all("call" not in vars(layer) for layer in layers)


def test_a_tracked_step_leaves_every_patched_object_as_it_was() -> None:
    """Taps, activations, regularizers, the loss scale and Keras' loss reduction."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="tanh", kernel_regularizer="l2")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer="adam", loss="mse")
    reduce_values = loss_module.reduce_values
    model.gradient_statistics(np.ones((4, 4), "float32"), np.zeros((4, 2), "float32"))
    for layer in model.layers[1:]:
        assert "call" not in vars(layer)
    assert loss_module.reduce_values is reduce_values
    assert "scale_loss" not in vars(model.optimizer)
    assert model.layers[1].kernel.regularizer.__class__.__name__ == "L2"

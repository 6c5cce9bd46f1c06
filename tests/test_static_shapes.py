"""`fit` traces with an unknown batch size; the rules must still see static sizes.

They choose between the Gram form and materialized per-example gradients from
static shapes; losing them (a regression once) sent Dense on 2-D inputs down
the materializing path, 18x slower at batch 512.
"""

from __future__ import annotations

import tensorflow as tf

from keras_gradtrack.rules import LayerCall
from keras_gradtrack.rules.ops import as_dense_sequences, reshape_per_example


def traced_with_unknown_batch(fn, *shapes):  # type: ignore[no-untyped-def]
    specs = [tf.TensorSpec([None, *shape], tf.float32) for shape in shapes]
    captured = {}

    @tf.function(input_signature=specs)
    def run(*tensors):  # type: ignore[no-untyped-def]
        captured["result"] = fn(*tensors)
        return tf.constant(0)

    run.get_concrete_function()
    return captured["result"]


def test_reshape_per_example_keeps_the_folded_size_static() -> None:
    folded = traced_with_unknown_batch(lambda t: reshape_per_example(t, [-1, 5]), (3, 4, 5))
    assert folded.shape.as_list() == [None, 12, 5]


def test_dense_rule_sees_a_2d_input_as_one_step_under_an_unknown_batch() -> None:
    def sequences(a: tf.Tensor, d: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        call = LayerCall(args=(a,), kwargs={}, tapped=[d], output_grads=[d])
        return as_dense_sequences([call])

    inputs, grads = traced_with_unknown_batch(sequences, (784,), (256,))
    assert inputs.shape.as_list() == [None, 1, 784]
    assert grads.shape.as_list() == [None, 1, 256]

"""The JAX engine: per-example gradient statistics from one `jax.value_and_grad`.

Chosen by `keras_gradtrack` when Keras runs on JAX; it imports no TensorFlow.
"""

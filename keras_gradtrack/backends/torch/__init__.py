"""The PyTorch engine: per-example gradient statistics from one `torch.autograd.grad`.

Chosen by `keras_gradtrack` when Keras runs on PyTorch (`KERAS_BACKEND=torch`); it
imports neither TensorFlow nor JAX. Its rules and step math are the ones the JAX
engine runs too (`backends/ops/`); what is PyTorch's own is how the probed tensors
are differentiated, the exact per-layer fallback (`torch.func`) and the trainer glue.
"""

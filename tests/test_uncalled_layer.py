"""A layer the forward pass does not call, on TensorFlow: the cases of
`uncalled_layer_cases.py` (JAX and PyTorch run them too), refused in the same words."""

from uncalled_layer_cases import *  # noqa: F403 (the shared cases, collected here)

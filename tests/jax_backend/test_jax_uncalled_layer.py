"""A layer the forward pass does not call, on JAX: the cases of `uncalled_layer_cases.py`,
which PyTorch runs too."""

from uncalled_layer_cases import *  # noqa: F403 (the shared cases, collected here)

"""Recurrent layers on JAX: the cases of `recurrent_cases.py` (the rule inside Keras'
`lax.scan`, the fallback off it), which PyTorch runs too."""

from recurrent_cases import *  # noqa: F403 (the shared cases, collected here)

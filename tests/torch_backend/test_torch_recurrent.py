"""Recurrent layers on PyTorch: the cases of `recurrent_cases.py` (the rule inside
Keras' loop over the steps, the fallback off it), which JAX runs too."""

from recurrent_cases import *  # noqa: F403 (the shared cases, collected here)

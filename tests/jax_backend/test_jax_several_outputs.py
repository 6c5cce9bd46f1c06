"""Losses over several outputs on JAX: the cases of `several_outputs_cases.py`, which
PyTorch runs too."""

from several_outputs_cases import *  # noqa: F403 (the shared cases, collected here)

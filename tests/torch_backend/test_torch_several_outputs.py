"""Losses over several outputs on PyTorch: the cases of `several_outputs_cases.py`,
which JAX runs too."""

from several_outputs_cases import *  # noqa: F403 (the shared cases, collected here)

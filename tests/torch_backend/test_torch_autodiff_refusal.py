"""keras_gradtrack.autodiff on PyTorch: the cases of `autodiff_refusal_cases.py`, which JAX runs too."""

from autodiff_refusal_cases import *  # noqa: F403 (the shared cases, collected here)

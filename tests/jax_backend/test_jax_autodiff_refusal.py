"""keras_gradtrack.autodiff on JAX: the cases of `autodiff_refusal_cases.py`, which PyTorch runs too."""

from autodiff_refusal_cases import *  # noqa: F403 (the shared cases, collected here)

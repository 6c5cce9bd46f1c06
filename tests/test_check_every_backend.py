"""`kgt.check` on TensorFlow: the cases of `check_cases.py`, which JAX and PyTorch run too."""

from check_cases import *  # noqa: F403 (the shared cases, collected here)

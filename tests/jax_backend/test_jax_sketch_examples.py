"""`kgt.attribution.sketch_examples` on JAX: the cases of `sketch_examples_cases.py`,
which PyTorch runs too."""

from sketch_examples_cases import *  # noqa: F403 (the shared cases, collected here)

"""`kgt.attribution.sketch_examples` on PyTorch: the cases of `sketch_examples_cases.py`,
which JAX runs too."""

from sketch_examples_cases import *  # noqa: F403 (the shared cases, collected here)

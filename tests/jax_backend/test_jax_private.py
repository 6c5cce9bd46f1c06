"""Private training on JAX: the update is the clipped sum of the per-example gradients
(against `jax.grad` per example), plus noise of deviation `sigma C`, over `B_expected`
(the cases of `private_step_cases.py`, which PyTorch runs too)."""

from private_step_cases import *  # noqa: F403 (the shared cases, collected here)

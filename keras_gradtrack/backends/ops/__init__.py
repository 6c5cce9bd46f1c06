"""What the probed engines (JAX, PyTorch) share, in `keras.ops`: the per-layer rules and the step's math.

Nothing here imports a backend: a backend gives the probes' gradients (one backward
pass over the variables and the probes) and its exact per-layer fallback, and these
modules turn them into the step's columns (docs/architecture.md).
"""

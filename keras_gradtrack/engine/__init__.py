"""The engine: taps, the tracking plan, the per-layer fallback and the tracked step.

Internal: nothing here is public API, and any of it may change in any release. The
public names are those of `keras_gradtrack.__all__` (`kgt.check` is defined here and
exported there); the rule contract is `keras_gradtrack.rules`.
"""

__all__: list[str] = []

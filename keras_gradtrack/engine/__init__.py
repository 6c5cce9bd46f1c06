"""The engine: taps, the tracking plan, the per-layer fallback and the tracked step."""

"""What `kgt.check` reports, on every backend: one row per tracked layer (its path and
form) and every refusal a tracked step would make, and its table (what the TensorFlow
engine's `gradient_tracking_summary()` prints). No backend imported: the TensorFlow engine
fills it by tracing the forward pass (`preflight.py`), the probed engines from their
plan and their example-independence guard (`backends/ops/check.py`).

Example:

```python
report = TrackingCheck((LayerPath(0, "dense", "Dense", 36, "rule:dense", "direct"),))
print(report)   # column, layer, class, params, path, form, note
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

REFUSED = "refused"
FALLBACK = "fallback"
UNKNOWN = "-"
# Forms of a layer in a traced step (`gradient_tracking_summary()`'s `form` column), on
# every engine.
MATERIALIZED = "materialized"  # the rule builds per-example gradients; G is their sum
DIRECT = "direct"  # the rule's primitives, without per-example gradients
JACOBIAN = "jacobian"  # the fallback
COUPLED = "coupled"  # rows of the loss vector's Jacobian (before a BatchNormalization in training)
# Below the table of a check that did not trace the forward pass.
UNTRACED_NOTE = (
    "Forms (-) are known after the first tracked step, or from "
    "kgt.check(model, x=...) with inputs of the model's shapes."
)


@dataclasses.dataclass(frozen=True)
class LayerPath:
    """One tracked layer's row in the summary.

    Attributes:
        column: Its column in the per-layer statistics.
        name: The column name.
        class_name: The layer's class.
        num_parameters: Its trainable parameters.
        path: `rule:<name>`, `fallback` (the exact per-layer Jacobian) or `refused`.
        form: `materialized`, `direct`, `jacobian`, or `-` when the shapes are unknown.
        note: Why the layer has no rule, why it is refused, or how it is called.
        refusal: The error a tracked step would raise for it (empty if none).
    """

    column: int
    name: str
    class_name: str
    num_parameters: int
    path: str
    form: str
    note: str = ""
    refusal: str = ""


def tracked_layer_path(
    column: int, tracked: Any, path: str, form: str, note: str, refusal: str = ""
) -> LayerPath:
    """The row of `tracked`, a `TrackedLayer` of either engine's plan."""
    layer_class = type(tracked.layer).__name__
    return LayerPath(
        column, tracked.name, layer_class, tracked.num_parameters, path, form, note, refusal
    )


@dataclasses.dataclass(frozen=True)
class TrackingCheck:
    """What `check` found: one row per tracked layer and every refusal.

    Attributes:
        layers: The rows, in column order.
        model_refusals: Errors a tracked step would raise that concern no single
            tracked layer (a loss added in `call`).
        traced: Whether the forward pass was traced (forms known).
        unknown_sizes: Whether an input size other than the batch's was unknown in
            the trace (a sequence of any length): a step with known sizes may take
            another form where the cheaper one depends on the length.
        untraced_note: What the table says of the forms when not `traced`.
    """

    layers: tuple[LayerPath, ...]
    model_refusals: tuple[str, ...] = ()
    traced: bool = True
    unknown_sizes: bool = False
    untraced_note: str = UNTRACED_NOTE

    @property
    def refusals(self) -> list[str]:
        """Every error a tracked step of this model would raise."""
        return [row.refusal for row in self.layers if row.refusal] + list(self.model_refusals)

    @property
    def fallback_layers(self) -> list[str]:
        """Names of the layers on the exact per-layer fallback (slower than a rule)."""
        return [row.name for row in self.layers if row.path == FALLBACK]

    def __str__(self) -> str:
        return format_check(self)


def format_check(report: TrackingCheck) -> str:
    """The summary table: column, layer, class, parameters, path, form, note; then
    every refusal in full."""
    rows = [("column", "layer", "class", "params", "path", "form", "note")]
    for row in report.layers:
        note = "refused, see below" if row.refusal else row.note
        rows.append(
            (
                str(row.column),
                row.name,
                row.class_name,
                str(row.num_parameters),
                row.path,
                row.form,
                note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    count = len(report.layers)
    fallbacks = len(report.fallback_layers)
    refused = sum(1 for row in report.layers if row.refusal)
    lines.append(f"{count} tracked layers, {fallbacks} on the fallback path, {refused} refused")
    if not report.traced:
        lines.append(report.untraced_note)
    if report.unknown_sizes:
        lines.append(
            "Some input sizes besides the batch's are unknown: where the cheaper form "
            "depends on them, a step with known sizes may take the other one "
            "(kgt.check(model, x=...) with inputs of your data's shapes tells)."
        )
    for refusal in report.refusals:
        lines.append(f"refused: {refusal}")
    return "\n".join(line.rstrip() for line in lines)

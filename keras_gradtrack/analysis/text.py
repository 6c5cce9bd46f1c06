"""Plain text: the summary of a log, and the aligned tables the command line prints."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from keras_gradtrack.analysis.tables import layer_summary, per_layer_statistics
from keras_gradtrack.io.schema import GRADIENT_SKETCH, PER_EXAMPLE_GROUP, TABLES, TARGET_INFLUENCE

if TYPE_CHECKING:
    from keras_gradtrack.io.reader import LogReader


def summary(log: LogReader) -> str:
    """What a log holds (steps, examples, layers) and the range of every statistic.

    Returns:
        A few aligned plain-text tables, as `keras-gradtrack summary` prints them.

    Example:

    ```python
    print(log.summary())
    ```
    """
    attrs = log.attrs
    steps, epochs = log.per_step("step"), log.per_step("epoch")
    batch_sizes, ids = log.per_step("batch_size"), log.per_example("example_id")
    versions = ", ".join(
        f"{name} {attrs[key]}"
        for name, key in (
            ("keras_gradtrack", "library_version"),
            ("keras", "keras_version"),
            ("tensorflow", "tensorflow_version"),
        )
        if key in attrs
    )
    header = [
        ("log", log.path),
        ("model", f"{attrs.get('model_name', '?')} ({versions}; created {attrs.get('created')})"),
        (
            "steps",
            f"{len(steps)} tracked: steps {_span(steps)}, epochs {_span(epochs)}, "
            f"batch size {_span(batch_sizes)}",
        ),
        ("examples", f"{len(ids)} rows, {len(np.unique(ids))} distinct ids"),
        ("layers", f"{len(log.layers)}: {', '.join(log.layers)}"),
    ]
    if "dp_noise_multiplier" in attrs:
        header.append(("privacy", _privacy(attrs)))
    sections = [text_table(header)]
    rows = []
    per_layer = per_layer_statistics(log)
    for kind in TABLES:
        names = log.per_example_names if kind == PER_EXAMPLE_GROUP else log.per_step_names
        for name in names:
            per = kind.removeprefix("per_") + (" x layer" if name in per_layer else "")
            if name == GRADIENT_SKETCH:
                # K numbers per row, meaningful only in products: not worth reading here.
                width = log.layout.widths(kind)[name]
                rows.append((name, f"{per} x {width} sketch numbers", "-", "-", "-", "-"))
                continue
            if name == TARGET_INFLUENCE:
                per += f" x target ({len(log.layout.target_ids)})"
            values = log.read(kind, name).astype(np.float64)
            rows.append((name, per, *_quantiles(values), str(int(np.isnan(values).sum()))))
    header_row = ("statistic", "per", "min", "median", "max", "NaN")
    sections.append(text_table(rows, header=header_row))
    layer_columns = [
        layer_summary(log, name, by="epoch") for name in per_layer if name in log.per_example_names
    ]
    if layer_columns and len(epochs):
        last_epoch = int(layer_columns[0].index[-1])
        layer_rows = [
            (layer, *(_number(column.values[-1, k]) for column in layer_columns))
            for k, layer in enumerate(log.layers)
        ]
        titles = [f"median {column.statistic}" for column in layer_columns]
        sections.append(
            f"per layer, epoch {last_epoch}:\n" + text_table(layer_rows, header=("layer", *titles))
        )
    return "\n\n".join(sections)


def _privacy(attrs: dict) -> str:
    """The private training's settings and, when the accountant wrote it, epsilon."""
    text = f"DP-SGD, {_bounds(attrs)}, sigma={attrs['dp_noise_multiplier']:.4g}"
    if "dp_epsilon" in attrs:
        text += (
            f"; epsilon {attrs['dp_epsilon']:.4g} at delta {attrs['dp_delta']:.3g} after "
            f"{attrs['dp_steps']} steps, q={attrs['dp_sampling_rate']:.4g} "
            f"({attrs['dp_accountant']}, Poisson sampling assumed)"
        )
    return text


def _bounds(attrs: dict) -> str:
    """`C=...`, or the bound of each group (or tracked layer) and the sensitivity."""
    sensitivity = float(attrs["dp_l2_norm_clip"])
    groups = json.loads(attrs.get("dp_clip_groups") or "{}")
    per_group = json.loads(attrs.get("dp_per_layer_clip") or "{}")
    if not groups and not per_group:
        return f"C={sensitivity:.4g}"
    if groups:  # one float for every group: the sensitivity is sqrt(K) C
        single = sensitivity / math.sqrt(len(groups))
        parts = [
            f"{name} C={float(per_group.get(name, single)):.4g} "
            f"({len(members)} layer{'s' * (len(members) != 1)})"
            for name, members in groups.items()
        ]
        kind = "group"
    else:
        parts = [f"{name} C={float(bound):.4g}" for name, bound in per_group.items()]
        kind = "layer"
    return f"bounds per {kind}: {', '.join(parts)} (sensitivity {sensitivity:.4g})"


def text_table(rows: Sequence[Sequence[object]], header: Sequence[str] | None = None) -> str:
    """Left-aligned columns separated by two spaces; a dashed rule under the header.

    Example:

    ```python
    print(text_table([(1, "a"), (22, "bb")], header=("id", "name")))
    ```
    """
    lines = [[str(cell) for cell in row] for row in rows]
    if header is not None:
        lines.insert(0, list(header))
    if not lines:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    if header is not None:
        lines.insert(1, ["-" * width for width in widths])
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines
    )


def _span(values: np.ndarray) -> str:
    if len(values) == 0:
        return "-"
    low, high = values.min(), values.max()
    return str(low) if low == high else f"{low}..{high}"


def _quantiles(values: np.ndarray) -> tuple[str, str, str]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return ("-", "-", "-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        low, middle, high = np.quantile(finite, [0.0, 0.5, 1.0])
    return _number(low), _number(middle), _number(high)


def _number(value: float) -> str:
    return "-" if not np.isfinite(value) else f"{value:.4g}"

"""The weights a gradient log keeps beside it: where they go and how they are named.

A log written with checkpoints (`HDF5GradientLogger(checkpoint_every=...)`) has
a directory beside it, the log's path with the suffix `.checkpoints`
(`run.h5` -> `run.checkpoints/`), holding one Keras weights file per checkpoint:
`step_<step>.weights.h5`, the weights the model had when that step of the log
began (before its update), `<step>` numbered as in `/per_step/step`. An HDF5
file in SWMR mode cannot gain new datasets, hence files of their own. A private
model's checkpoint also holds its privacy history at that moment (the root
attribute `privacy_history`, JSON: the privacy spent by the weights it holds).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import h5py

CHECKPOINT_SUFFIX = ".checkpoints"
PRIVACY_HISTORY_ATTR = "privacy_history"
_NAME = re.compile(r"^step_(\d+)\.weights\.h5$")


def checkpoint_directory(log_path: str | os.PathLike[str]) -> Path:
    """The directory of a log's checkpoints: `run.h5` -> `run.checkpoints`."""
    return Path(log_path).with_suffix(CHECKPOINT_SUFFIX)


def checkpoint_path(log_path: str | os.PathLike[str], step: int) -> Path:
    """The weights file of the checkpoint taken when `step` began."""
    return checkpoint_directory(log_path) / f"step_{step:09d}.weights.h5"


def checkpoints(log_path: str | os.PathLike[str]) -> dict[int, Path]:
    """`{step: weights file}` of a log's checkpoints, by step (empty without any)."""
    directory = checkpoint_directory(log_path)
    if not directory.is_dir():
        return {}
    found = {}
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def check_checkpoints(log_path: str | os.PathLike[str], *, overwrite: bool, append: bool) -> None:
    """Raises if a new log would be written beside the checkpoints of another one.

    Raises:
        FileExistsError: if the checkpoint directory holds checkpoints and
            neither `overwrite` (they are removed when the log is made) nor
            `append` (they continue) is set.
    """
    if checkpoints(log_path) and not (overwrite or append):
        raise FileExistsError(
            f"'{checkpoint_directory(log_path)}' holds checkpoints of another log. To "
            "replace them pass overwrite=True; to continue them pass append=True."
        )


def remove_checkpoints(log_path: str | os.PathLike[str]) -> None:
    """Removes a log's checkpoint files (not other files of the directory)."""
    for path in checkpoints(log_path).values():
        path.unlink()


def write_privacy_history(path: str | os.PathLike[str], history_json: str) -> None:
    """Writes a private model's history (JSON, `privacy.history.history_json`) into a
    checkpoint."""
    with h5py.File(path, "r+") as file:
        file.attrs[PRIVACY_HISTORY_ATTR] = history_json


def privacy_history_of(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The privacy history a checkpoint's weights were trained with: one dict per
    phase (`noise_multiplier`, `sampling_rate`, `steps`, `sampling`; empty: none).
    `keras_gradtrack.privacy.PrivacyPhase(**phase)` makes a phase of each.

    Example:

    ```python
    for step, path in checkpoints("run.h5").items():
        print(step, privacy_history_of(path))
    ```
    """
    with h5py.File(path, "r") as file:
        text = file.attrs.get(PRIVACY_HISTORY_ATTR, "")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return list(json.loads(text)) if text else []


def save_checkpoint(model: Any, path: Path) -> None:
    """Saves the model's weights (not the optimizer's) as a Keras `.weights.h5` file."""
    from keras_gradtrack._keras_seam import saving_lib  # Keras only here: reading logs needs none

    skipped = [model.optimizer] if getattr(model, "optimizer", None) is not None else None
    saving_lib.save_weights_only(model, path, objects_to_skip=skipped)


def load_checkpoint(model: Any, path: Path) -> None:
    """Loads weights `save_checkpoint` saved; the model's optimizer is left as it is."""
    from keras_gradtrack._keras_seam import saving_lib

    skipped = [model.optimizer] if getattr(model, "optimizer", None) is not None else None
    saving_lib.load_weights_only(model, path, objects_to_skip=skipped)

"""The one seam to Keras' internals (`keras_gradtrack._keras_seam`): every private name
resolves in the installed Keras, no other module reaches past the seam, and the copy
of Keras' train step is Keras' own but for the documented substitutions."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from source_compare import normalized

from keras_gradtrack import _keras_seam
from keras_gradtrack.backends.ops.mixin import ProbedTrackingMixin
from keras_gradtrack.models.trainer import GradientTrackingMixin

PACKAGE = Path(_keras_seam.__file__).resolve().parent
PRIVATE_MODULES = ("keras.src", "tensorflow.python")


@pytest.mark.parametrize("name", sorted(_keras_seam.PRIVATE_NAMES))
def test_the_private_name_is_where_the_seam_expects_it(name: str) -> None:
    try:
        _keras_seam.PRIVATE_NAMES[name]()
    except (AttributeError, ImportError, TypeError) as error:
        pytest.fail(
            f"Keras {keras.__version__} (TensorFlow {tf.__version__}) moved or removed "
            f"{name}, which keras_gradtrack/_keras_seam.py relies on: {error!r}. Update "
            "the seam (and the README's count of private names)."
        )


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_keras_seam.py")


def private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("keras.src"):
            names = [ast.unparse(node)]
        else:
            continue
        found += [n for n in names if n.startswith(PRIVATE_MODULES) or "__internal__" in n]
    return found


# The private attributes only `GradientTrackingMixin` reads, of itself (its copy of
# Keras' train step and the hooks it overrides): `_keras_seam.TRAINER_ATTRIBUTES`.
KERAS_OBJECTS = ("model", "layer", "variable", "functional", "cell")


def private_attributes(tree: ast.AST) -> list[str]:
    """`_`-prefixed attributes read from a Keras object (by the names the package
    gives them), other than the mixins' own (TensorFlow's, and what the probed engines'
    share)."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            owner = ast.unparse(node.value)
            ours = any(
                hasattr(mixin, node.attr) for mixin in (GradientTrackingMixin, ProbedTrackingMixin)
            ) and not hasattr(keras.Model, node.attr)
            if owner.split(".")[-1] in KERAS_OBJECTS and not ours:
                found.append(f"{owner}.{node.attr}")
    return found


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reaches_past_the_seam(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not private_imports(tree), "import it through keras_gradtrack/_keras_seam.py"
    assert not private_attributes(tree), "read it through keras_gradtrack/_keras_seam.py"


def test_the_source_walk_finds_a_planted_private_name() -> None:
    planted = ast.parse("from keras.src import backend\nx = model._flatten_layers()")
    assert private_imports(planted) == ["keras.src"]
    assert private_attributes(planted) == ["model._flatten_layers"]


def test_the_mixin_reads_only_the_trainer_attributes_the_seam_lists() -> None:
    tree = ast.parse(Path(inspect.getfile(GradientTrackingMixin)).read_text())
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and ast.unparse(node.value) in ("self", "super()")
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and hasattr(keras.Model, node.attr)
    }
    assert read <= set(_keras_seam.TRAINER_ATTRIBUTES), sorted(
        read - set(_keras_seam.TRAINER_ATTRIBUTES)
    )


# Keras' forward pass and compiled loss, which the mixin's step takes from
# `_forward_and_loss` (the tracked `gradient_statistics` runs the same).
KERAS_FORWARD = """\
        if self._call_has_training_arg:
            y_pred = self(x, training=True)
        else:
            y_pred = self(x)
        loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
"""

# (what Keras' train step says, what the mixin's says instead): each documented.
SUBSTITUTIONS = [
    # The forward pass, factored out (and run inside the tape that watches inputs).
    (KERAS_FORWARD, "        y_pred, loss = self._forward_and_loss(tape, x, y, sample_weight)\n"),
    # The loss tracker's batch size from the one helper that knows example ids.
    (
        "sample_weight=tf.shape(next((i for i in tree.flatten(x) if i is not None)))[0])",
        "sample_weight=batch_size_of(x))",
    ),
    # The trainable weights read once (each read collects them again).
    (
        "    if self.trainable_weights:\n        trainable_weights = self.trainable_weights\n",
        "    trainable_weights = self.trainable_weights\n    if trainable_weights:\n",
    ),
    # The substitution the mixin exists for.
    (
        "gradients = tape.gradient(loss, trainable_weights)",
        "gradients = self.tracked_gradient(tape, loss, trainable_weights)",
    ),
    # The warning points at the caller.
    (
        "warnings.warn('The model does not have any trainable weights.')",
        "warnings.warn('The model does not have any trainable weights.', stacklevel=2)",
    ),
]


def test_the_copied_train_step_is_keras_own_but_for_the_substitutions() -> None:
    expected = normalized(TensorFlowTrainer.train_step) + "\n"
    for keras_says, mixin_says in SUBSTITUTIONS:
        assert keras_says in expected, (
            f"Keras {keras.__version__}'s TensorFlowTrainer.train_step changed: it no longer "
            f"says\n{keras_says}\nCompare it with GradientTrackingMixin.train_step and "
            "update the copy (keras_gradtrack/models/trainer.py) and this test."
        )
        expected = expected.replace(keras_says, mixin_says)
    assert normalized(GradientTrackingMixin.train_step) + "\n" == expected, (
        f"GradientTrackingMixin.train_step differs from Keras {keras.__version__}'s "
        "TensorFlowTrainer.train_step beyond the documented substitutions."
    )


def test_the_factored_forward_is_keras_own() -> None:
    forward = textwrap.dedent(KERAS_FORWARD)
    ours = normalized(GradientTrackingMixin._forward_and_loss)
    assert textwrap.indent(forward, "    ") in ours + "\n"

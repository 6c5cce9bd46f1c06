"""A function's code as text without its docstring, comments and annotations: how the
tests compare a copy of a Keras step with the installed Keras (no backend imported)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


def normalized(function: Any) -> str:
    """The function's code without its docstring, comments and annotations."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    assert isinstance(definition, ast.FunctionDef)
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        definition.body = body[1:]
    definition.returns = None
    for argument in definition.args.args:
        argument.annotation = None
    return ast.unparse(definition)

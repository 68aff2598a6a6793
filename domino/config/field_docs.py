"""A dataclass field's documentation is the string literal below it: read here for flags, kfp parameters and docs."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Dict


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """Returns ``{field name: docstring}`` read from the string literal below each field of ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))  # dedented: a class may be defined in a function
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[node.target.id] = following.value.value.strip()
    return docs


def flag_name(field_name: str) -> str:
    """``micro_batch_size`` -> ``--micro-batch-size``."""
    return "--" + field_name.replace("_", "-")

"""Pull the code out of a model's answer: the last fenced Python block that parses."""

from __future__ import annotations

import ast
import re
import warnings

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}


def _parses(code: str) -> bool:
    try:
        with warnings.catch_warnings():  # SyntaxWarnings about graded code are not ours to show
            warnings.simplefilter("ignore")
            ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(completion: str) -> str | None:
    """The last fenced block tagged python (or untagged) that parses; None when there is none.

    An unterminated final fence (a completion cut at the length limit) is considered too.
    """
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(completion)]
    for tag, body in reversed(blocks):
        if tag in _PYTHON_TAGS and body.strip() and _parses(body):
            return body.rstrip() + "\n"
    return None

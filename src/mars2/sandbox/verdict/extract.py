"""Pull the code out of a model's answer, by the rule of a grading profile.

``lcb`` (LiveCodeBench's rule for chat models): the lines strictly between the last two lines that
contain a triple backtick, whatever their language tag, parsing or not; no code when fewer than two
such lines exist. ``lenient``: the last fenced block tagged python (or untagged) that parses,
an unterminated final fence included.
"""

from __future__ import annotations

import ast
import re
import warnings

from mars2.sandbox.verdict.compare import DEFAULT_PROFILE, get_profile

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


def extract_lcb(completion: str) -> str | None:
    """The text between the last two fence lines; None when there are fewer than two or it is blank."""
    lines = completion.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return None
    body = "\n".join(lines[fences[-2] + 1 : fences[-1]])
    # LiveCodeBench runs blank code too, and it always fails: no code is the same verdict.
    return body + "\n" if body.strip() else None


def extract_lenient(completion: str) -> str | None:
    """The last fenced block tagged python (or untagged) that parses; None when there is none.

    An unterminated final fence (a completion cut at the length limit) is considered too.
    """
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(completion)]
    for tag, body in reversed(blocks):
        if tag in _PYTHON_TAGS and body.strip() and _parses(body):
            return body.rstrip() + "\n"
    return None


def extract_code(completion: str, profile: str = DEFAULT_PROFILE) -> str | None:
    """The code of `completion` by `profile`'s rule; None when it holds none."""
    if get_profile(profile).name == "lcb":
        return extract_lcb(completion)
    return extract_lenient(completion)

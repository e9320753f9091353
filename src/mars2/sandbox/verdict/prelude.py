"""The source each grading profile runs in an answer's namespace before the answer's own code.

Standard library only and free of mars2 imports: the sandbox child imports it, and the E2B sandbox
ships it next to the harness. LiveCodeBench puts a fixed block of imports before every answer (so
that code written against its starter code may use ``List`` or ``defaultdict`` without importing
them) and raises the recursion limit there; the ``lcb`` profile reproduces that block. The
``lenient`` profile adds nothing.
"""

from __future__ import annotations

from types import CodeType

# LiveCodeBench's star imports, in its order: the order decides which module wins a shared name
# (``builtins`` after ``math``/``io``/``sys`` restores pow/open/exit; ``typing`` last makes
# ``Counter``/``OrderedDict`` the typing aliases, which still construct the collections classes).
LCB_STAR_MODULES = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
    "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing",
)  # fmt: skip
# Then each of these is bound as a module name, which undoes the star imports' shadowing of
# e.g. ``random``, ``datetime`` and ``copy``.
LCB_MODULE_NAMES = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
    "statistics", "itertools", "functools", "operator", "io", "sys", "json",
)  # fmt: skip
LCB_RECURSION_LIMIT = 50000

# What a worker should import before forking children for a profile, so that running the
# prelude in a child costs a dictionary update, not module loading.
PRELOAD_MODULES = {
    "lenient": (),
    "lcb": tuple(m for m in LCB_STAR_MODULES if m != "builtins"),
}


def _lcb_source() -> str:
    lines = [f"from {name} import *" for name in LCB_STAR_MODULES]
    lines += [f"import {name}" for name in LCB_MODULE_NAMES]
    lines.append(f"sys.setrecursionlimit({LCB_RECURSION_LIMIT})")
    return "\n".join(lines) + "\n"


_SOURCES = {"lenient": "", "lcb": _lcb_source()}
_COMPILED: dict[str, CodeType] = {}


def prelude_source(profile: str) -> str:
    """The prelude source text of a profile ('' when it has none)."""
    try:
        return _SOURCES[profile]
    except KeyError:
        raise ValueError(
            f"unknown grading profile {profile!r}: use one of {sorted(_SOURCES)}"
        ) from None


def compiled(profile: str) -> CodeType:
    """The profile's prelude compiled once per process (as its own module: no inherited flags)."""
    code = _COMPILED.get(profile)
    if code is None:
        code = compile(prelude_source(profile), "<prelude>", "exec", dont_inherit=True)
        _COMPILED[profile] = code
    return code

"""Grading profiles: how an answer's raw output is judged against a test's expected output.

Standard library only and free of mars2 imports except `prelude`: the sandbox child uses
`encode_value` and `find_callable`, the worker (outside the answer's process) decides verdicts with
`compare_stdout` / `compare_call`, and the E2B sandbox ships this file next to the harness.

Two profiles:

``lcb``
    LiveCodeBench's verdicts. Standard-input answers: both texts are stripped, split on newlines,
    each line stripped; the line counts must agree and each line must match exactly or, token by
    token, as equal ``Decimal`` numbers. Call answers: a returned tuple becomes a list (top level
    only), then the value must be ``==`` to the JSON-decoded expected output -- no float tolerance,
    nested tuples never equal lists, ``{1: x}`` never equals ``{"1": x}``, a bare element never
    equals a one-item list. When the text ``class Solution`` occurs in the code the function is only
    looked up on one ``Solution()`` instance shared by every test; otherwise at module level.
``lenient``
    The project's earlier rules, kept for training rewards: the same stdout rule; call results
    compared after turning nested tuples into lists and dict keys into strings, floats within
    1e-9, a bare element accepted for a one-item list, and a module-level function used when
    ``class Solution`` lacks the method.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

try:  # inside the mars2 package
    from mars2.sandbox.verdict import prelude as _prelude
except ImportError:  # shipped as loose files next to the harness (E2B)
    import prelude as _prelude  # type: ignore[no-redef]

PROFILE_NAMES = ("lenient", "lcb")
DEFAULT_PROFILE = "lenient"
_ENCODE_DEPTH = 500  # deeper (or self-containing) values are encoded as opaque
LCB_INT_DIGITS = 50000  # LiveCodeBench's sys.set_int_max_str_digits
_SHORT_INT = 4000  # digit strings this short convert under any interpreter's digit limit


def clip(text: str, cap: int) -> str:
    """Shorten `text` to `cap` characters, saying how much was cut."""
    return text if len(text) <= cap else text[:cap] + f"... [{len(text) - cap} more chars]"


class Profile:
    """What a grading profile asks of the harness, besides its comparison rules."""

    __slots__ = (
        "call_exit_is_error",
        "exit_status_matters",
        "int_max_str_digits",
        "job_time_cap",
        "name",
        "prelude",
        "recursion_limit",
        "solution_rule",
    )

    def __init__(
        self,
        name: str,
        recursion_limit: int,
        int_max_str_digits: int | None,
        exit_status_matters: bool,
        job_time_cap: bool,
    ) -> None:
        self.name = name
        self.prelude = _prelude.prelude_source(name)
        self.recursion_limit = recursion_limit
        self.int_max_str_digits = int_max_str_digits
        self.exit_status_matters = exit_status_matters
        self.call_exit_is_error = True
        self.solution_rule = name
        self.job_time_cap = job_time_cap

    def job_wall_bound(self, per_test_timeout: float, n_tests: int, configured: float) -> float:
        """Seconds all tests of one answer may take in wall-clock time.

        With a whole-answer cap that is the configured job timeout. Without one (``lcb``) it is a
        safety net only, never tighter than LiveCodeBench's own bound, (per test + 1) * tests + 5.
        """
        if self.job_time_cap:
            return configured
        return max(configured, (per_test_timeout + 1.0) * max(n_tests, 1) + 5.0)

    def __repr__(self) -> str:
        return f"Profile({self.name!r})"


_PROFILES = {
    # 10000 was the harness's floor before profiles existed; the interpreter's digit limit stays.
    "lenient": Profile("lenient", 10000, None, exit_status_matters=True, job_time_cap=True),
    # LiveCodeBench: its prelude sets the recursion limit to 50000 and its grading module the
    # int/str digit limit to 50000 (inherited by the processes that run answers); its stdin runner
    # swallows SystemExit whatever the code; its only whole-answer bound grows with the tests.
    "lcb": Profile(
        "lcb",
        _prelude.LCB_RECURSION_LIMIT,
        LCB_INT_DIGITS,
        exit_status_matters=False,
        job_time_cap=False,
    ),
}


def get_profile(name: str) -> Profile:
    """The named profile; ValueError for an unknown name."""
    try:
        return _PROFILES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown grading profile {name!r}: use one of {list(PROFILE_NAMES)}"
        ) from None


# --- standard input -------------------------------------------------------------------------


def _numeric_tokens(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except (InvalidOperation, ValueError):
        return None


def compare_stdout(actual: str, expected: str, profile: str = DEFAULT_PROFILE) -> bool:
    """Whitespace-stripped lines must match; a mismatching line may still match as numbers.

    The rule is LiveCodeBench's and the same in every profile.
    """
    get_profile(profile)
    got = [line.strip() for line in actual.strip().split("\n")]
    want = [line.strip() for line in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        na, nb = _numeric_tokens(a), _numeric_tokens(b)
        if na is None or nb is None or na != nb:
            return False
    return True


# --- call results: encoding in the child ------------------------------------------------------


class Opaque:
    """A returned value with no data form (an object, a function...): equal to nothing."""

    __slots__ = ("text", "type_name")

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name = type_name
        self.text = text

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return self.text


def _opaque(value: Any) -> dict[str, str]:
    try:
        text = clip(repr(value), 300)
    except BaseException:  # a user __repr__ may raise anything
        text = "<unprintable>"
    return {"__repr__": text, "__type__": type(value).__name__}


def encode_value(value: Any, _depth: int = 0) -> Any:
    """A returned value as JSON-ready data that keeps every difference Python's `==` can see.

    Tuples, dicts (with their key types) and sets are tagged objects; ints too long for `str`
    are hex; other number types become int or (when exact) float; anything else is opaque.
    Never raises.
    """
    if _depth > _ENCODE_DEPTH:
        return {"__repr__": "<too deep>", "__type__": type(value).__name__}
    try:
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if kind is float:
            return value
        if kind is int:
            return value if value.bit_length() < 8000 else {"__int_hex__": hex(value)}
        if kind is list:
            return [encode_value(v, _depth + 1) for v in value]
        if kind is tuple:
            return {"__tuple__": [encode_value(v, _depth + 1) for v in value]}
        if kind is dict:
            return {
                "__dict__": [
                    [encode_value(k, _depth + 1), encode_value(v, _depth + 1)]
                    for k, v in value.items()
                ]
            }
        if kind is set or kind is frozenset:
            return {"__set__": [encode_value(v, _depth + 1) for v in value]}
        # Subclasses and foreign numbers (numpy scalars): the plain value they are equal to.
        if isinstance(value, bool):
            return bool(value)
        if isinstance(value, numbers.Integral):
            return encode_value(int(value), _depth)
        if isinstance(value, numbers.Real):
            as_float = float(value)
            return as_float if as_float == value else _opaque(value)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, list):
            return encode_value(list(value), _depth)
        if isinstance(value, tuple):
            return encode_value(tuple(value), _depth)
        if isinstance(value, dict):
            return encode_value(dict(value), _depth)
    except BaseException:  # user subclasses may raise anything from their methods
        pass
    return _opaque(value)


# --- call results: decoding and comparison in the worker --------------------------------------


def _hashable(value: Any) -> Any:
    return value if value.__hash__ is not None else Opaque(type(value).__name__, repr(value))


def decode_value(data: Any) -> Any:
    """Reverse `encode_value` (after a JSON round trip)."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple(decode_value(v) for v in data["__tuple__"])
    if "__dict__" in data:
        return {_hashable(decode_value(k)): decode_value(v) for k, v in data["__dict__"]}
    if "__set__" in data:
        return frozenset(_hashable(decode_value(v)) for v in data["__set__"])
    if "__int_hex__" in data:
        return int(data["__int_hex__"], 16)
    if "__repr__" in data:
        return Opaque(str(data.get("__type__", "object")), str(data["__repr__"]))
    raise ValueError(f"not an encoded value: {data!r}")


def parse_call_args(text: str) -> list[Any]:
    """A call test's arguments: one JSON value per input line (blank lines ignored)."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def _lenient_normalise(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_lenient_normalise(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _lenient_normalise(v) for k, v in value.items()}
    return value


def call_values_equal(actual: Any, expected: Any, profile: str = DEFAULT_PROFILE) -> bool:
    """Whether a returned Python value counts as the expected (JSON-decoded) one."""
    if get_profile(profile).name == "lcb":
        if type(actual) is tuple:
            actual = list(actual)
        try:
            return bool(actual == expected)
        except RecursionError:
            return False
    a, b = _lenient_normalise(actual), _lenient_normalise(expected)
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        try:
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
        except OverflowError:
            return False  # an int beyond any float: no float is close to it
    if isinstance(b, list) and len(b) == 1 and a == b[0]:
        return True
    return False


def compare_call(actual: Any, expected: str, profile: str = DEFAULT_PROFILE) -> bool:
    """Judge a call test: `actual` is `encode_value` output, `expected` the test's JSON text.

    ValueError when `expected` is not JSON (a broken dataset row, not a wrong answer).
    """
    limit = get_profile(profile).int_max_str_digits

    def parse_int(text: str) -> int:
        # The judge's process keeps the interpreter's digit limit; the profile's is what counts.
        if len(text) <= _SHORT_INT or limit is None:
            return int(text)
        if len(text.lstrip("-")) > limit:
            raise ValueError(f"an integer of {len(text)} digits exceeds the limit {limit}")
        return int(Decimal(text))

    try:
        want = json.loads(expected, parse_int=parse_int)
    except ValueError as err:
        raise ValueError(f"expected output is not JSON: {clip(expected, 200)!r}") from err
    return call_values_equal(decode_value(actual), want, profile)


# --- finding the function (in the child) -------------------------------------------------------


def find_callable(
    namespace: dict[str, Any], fn_name: str, code: str, profile: str = DEFAULT_PROFILE
) -> Callable[..., Any]:
    """The function a call test calls; NameError when the answer has none by that rule.

    Call once per process and reuse the result: under ``lcb`` every test shares one
    ``Solution()`` instance, as in LiveCodeBench.
    """
    rule = get_profile(profile).solution_rule
    solution_cls = namespace.get("Solution")
    if rule == "lcb" and "class Solution" in code:
        if not isinstance(solution_cls, type):
            raise NameError("the code mentions class Solution but defines no class Solution")
        method = getattr(solution_cls(), fn_name, None)
        if method is None:
            raise NameError(f"class Solution has no method {fn_name!r}")
        return method
    if rule == "lenient" and isinstance(solution_cls, type) and hasattr(solution_cls, fn_name):
        return getattr(solution_cls(), fn_name)
    fn = namespace.get(fn_name)
    if callable(fn):
        return fn
    raise NameError(f"no function or Solution method named {fn_name!r}")

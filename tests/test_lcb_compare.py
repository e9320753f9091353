"""Grading profiles without a sandbox: value encoding, comparison rules, extraction, prelude."""

from __future__ import annotations

import enum
import json
import sys
from fractions import Fraction
from typing import Any

import pytest

from mars2.data.loaders import GRADING_PROFILES
from mars2.sandbox.verdict import compare, prelude
from mars2.sandbox.verdict.compare import (
    Opaque,
    call_values_equal,
    compare_call,
    compare_stdout,
    decode_value,
    encode_value,
    find_callable,
    get_profile,
)
from mars2.sandbox.verdict.extract import extract_code, extract_lcb


def _round_trip(value: Any) -> Any:
    return decode_value(json.loads(json.dumps(encode_value(value))))


class Colour(enum.IntEnum):
    RED = 1


class Float(float):
    pass


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -7, 1.5, "x", [1, [2, (3, 4)]], (1, "a"), {1: "a", "1": (2,)}, 2**20000],
    ids=lambda v: type(v).__name__,
)
def test_encoding_round_trips_plain_data(value: Any) -> None:
    back = _round_trip(value)
    assert back == value and type(back) is type(value)


def test_encoding_keeps_what_equality_sees_and_drops_the_rest() -> None:
    assert _round_trip(frozenset({1, 2})) == frozenset({1, 2})
    assert _round_trip(Colour.RED) == 1 and type(_round_trip(Colour.RED)) is int
    assert type(_round_trip(Float(0.5))) is float
    assert _round_trip(Fraction(1, 2)) == 0.5
    third = _round_trip(Fraction(1, 3))  # no exact float: opaque
    assert isinstance(third, Opaque) and third != third and "Fraction" in third.type_name
    loop: list[Any] = []
    loop.append(loop)
    assert isinstance(json.dumps(encode_value(loop)), str)  # never raises

    class Liar:
        def __eq__(self, other: object) -> bool:
            return True

        def __repr__(self) -> str:
            raise RuntimeError("no")

    liar = _round_trip(Liar())
    assert isinstance(liar, Opaque) and not call_values_equal(liar, 1, "lcb")


# (actual returned value, expected JSON text, lcb verdict, lenient verdict)
CALL_CASES = [
    ((1, 2), "[1, 2]", True, True),
    ([(1, 2)], "[[1, 2]]", False, True),
    (0.1 + 0.2, "0.3", False, True),
    (2.0, "2", True, True),
    (1, "true", True, True),
    ("true", "true", False, False),
    (5, "[5]", False, True),
    ({1: 2}, '{"1": 2}', False, True),
    ({"a": 1}, '{"a": 1}', True, True),
    (None, "null", True, True),
    ([1, 2], "[2, 1]", False, False),
    (float("nan"), "NaN", False, False),
]


@pytest.mark.parametrize("actual,expected,lcb,lenient", CALL_CASES, ids=lambda v: str(v)[:20])
def test_call_comparison_per_profile(actual: Any, expected: str, lcb: bool, lenient: bool) -> None:
    encoded = json.loads(json.dumps(encode_value(actual)))
    assert compare_call(encoded, expected, "lcb") is lcb
    assert compare_call(encoded, expected, "lenient") is lenient


def test_compare_call_rejects_expected_output_that_is_not_json() -> None:
    with pytest.raises(ValueError, match="expected output is not JSON"):
        compare_call(1, "[1,", "lcb")


def test_long_expected_integers_parse_up_to_the_profile_limit() -> None:
    big = 10**20000 + 7  # past the interpreter's default 4300 digits, under LCB's 50000
    text = "[" + str(big) + "]" if sys.get_int_max_str_digits() == 0 else None
    if text is None:
        before = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
        try:
            text = "[" + str(big) + "]"
        finally:
            sys.set_int_max_str_digits(before)
    assert compare_call(encode_value([big]), text, "lcb")
    assert not compare_call(encode_value([big + 1]), text, "lcb")
    with pytest.raises(ValueError):
        compare_call(encode_value(1), "1" * 60000, "lcb")  # beyond LCB's limit too


def test_stdout_rule_is_lcb_in_both_profiles() -> None:
    for profile in ("lcb", "lenient"):
        assert compare_stdout("  3 \n\n", "3\n", profile)
        assert compare_stdout("2.50\n", "2.5", profile)
        assert compare_stdout("3e0", "3", profile)
        assert not compare_stdout("2.500001", "2.5", profile)
        assert not compare_stdout("YES", "Yes", profile)
        assert not compare_stdout("1\n2", "1 2", profile)


def test_find_callable_rules() -> None:
    class Solution:
        def f(self) -> int:
            return 1

    def f() -> int:
        return 2

    both = {"Solution": Solution, "f": f}
    assert find_callable(both, "f", "class Solution: ...", "lcb")() == 1
    empty_cls = {"Solution": type("Solution", (), {}), "f": f}
    with pytest.raises(NameError):
        find_callable(empty_cls, "f", "class Solution: pass", "lcb")
    assert find_callable(empty_cls, "f", "class Solution: pass", "lenient")() == 2
    assert find_callable({"f": f}, "f", "def f(): ...", "lcb")() == 2
    with pytest.raises(NameError):
        find_callable({"f": f}, "f", "# class Solution\ndef f(): ...", "lcb")


def test_lcb_extraction_takes_the_last_two_fence_lines() -> None:
    text = "```python\nprint(1)\n```\nthen\n```text\n3\n```"
    assert extract_lcb(text) == "3\n"
    assert extract_code(text, "lenient") == "print(1)\n"
    assert extract_lcb("```python\nprint(1)\n") is None  # one fence line
    assert extract_code("```python\nprint(1)\n", "lenient") == "print(1)\n"
    assert extract_lcb("```cpp\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```cpp\nprint(2)\n```", "lenient") is None
    assert extract_lcb("```\n\n```") is None
    assert extract_lcb("x ```python\na = 1\nb = 2\n``` y") == "a = 1\nb = 2\n"


def test_lcb_prelude_defines_starter_names_and_limits() -> None:
    namespace: dict[str, Any] = {}
    before = sys.getrecursionlimit()
    try:
        exec(prelude.compiled("lcb"), namespace)
        assert sys.getrecursionlimit() == 50000
    finally:
        sys.setrecursionlimit(before)
    for name in ("List", "Optional", "defaultdict", "deque", "heappush", "bisect_left", "gcd",
                 "inf", "accumulate", "lru_cache", "reduce", "add", "sqrt", "comb"):  # fmt: skip
        assert name in namespace, name
    assert namespace["pow"](3, 2, 5) == 4  # builtins' pow, not math's
    assert namespace["random"].__name__ == "random" and namespace["math"].__name__ == "math"
    assert prelude.prelude_source("lenient") == ""
    with pytest.raises(ValueError, match="unknown grading profile"):
        prelude.prelude_source("strict")


def test_profiles() -> None:
    assert set(GRADING_PROFILES) == set(compare.PROFILE_NAMES)
    lcb, lenient = get_profile("lcb"), get_profile("lenient")
    assert (lcb.recursion_limit, lcb.int_max_str_digits, lcb.exit_status_matters) == (
        50000,
        50000,
        False,
    )
    assert lenient.exit_status_matters and lenient.prelude == ""
    # LiveCodeBench's own bound grows with the tests; lenient keeps the configured cap.
    assert lcb.job_wall_bound(6.0, 100, 60.0) == 7.0 * 100 + 5.0
    assert lcb.job_wall_bound(6.0, 1, 60.0) == 60.0
    assert lenient.job_wall_bound(6.0, 100, 60.0) == 60.0
    with pytest.raises(ValueError, match="unknown grading profile"):
        get_profile("strict")

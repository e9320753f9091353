"""The bundled toy problem set: small stdin and call problems, generated deterministically.

It exists so that the demo, the tests and the learning curve run offline. Every problem carries a
reference solution in ``metadata["reference_solution"]`` (the test suite checks that it passes).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mars2.data.problem import Problem, TestCase, TestKind


@dataclass(frozen=True)
class _StdinFamily:
    name: str
    statement: str
    solution: str
    make_input: Callable[[random.Random], str]
    answer: Callable[[str], str]


@dataclass(frozen=True)
class _CallFamily:
    name: str
    fn_name: str
    statement: str
    solution: str
    make_args: Callable[[random.Random], list[Any]]
    answer: Callable[..., Any]


def _two_ints(rng: random.Random) -> str:
    return f"{rng.randint(-50, 99)} {rng.randint(-50, 99)}"


def _int_list(rng: random.Random) -> str:
    values = [rng.randint(-20, 40) for _ in range(rng.randint(1, 7))]
    return f"{len(values)}\n{' '.join(map(str, values))}"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeioxyz") for _ in range(rng.randint(1, 9)))


def _scaled(text: str, k: int) -> str:
    return str(int(text) * k)


def _shifted(text: str, k: int) -> str:
    return str(int(text) + k)


def _ints_of(text: str) -> list[int]:
    return [int(tok) for tok in text.split()]


def _stdin_families() -> list[_StdinFamily]:
    pair = "Read two integers a and b from one line of standard input and print {what}."
    nums = "Read n, then n integers on the next line, and print {what}."
    word = "Read one word from standard input and print {what}."
    read_pair = "a, b = map(int, input().split())\n"
    read_nums = "n = int(input())\nxs = list(map(int, input().split()))\n"
    fams = [
        _StdinFamily(
            "sum",
            pair.format(what="a + b"),
            read_pair + "print(a + b)\n",
            _two_ints,
            lambda s: str(sum(_ints_of(s))),
        ),
        _StdinFamily(
            "diff",
            pair.format(what="a - b"),
            read_pair + "print(a - b)\n",
            _two_ints,
            lambda s: str(_ints_of(s)[0] - _ints_of(s)[1]),
        ),
        _StdinFamily(
            "prod",
            pair.format(what="a * b"),
            read_pair + "print(a * b)\n",
            _two_ints,
            lambda s: str(_ints_of(s)[0] * _ints_of(s)[1]),
        ),
        _StdinFamily(
            "max2",
            pair.format(what="the larger of the two"),
            read_pair + "print(max(a, b))\n",
            _two_ints,
            lambda s: str(max(_ints_of(s))),
        ),
        _StdinFamily(
            "min2",
            pair.format(what="the smaller of the two"),
            read_pair + "print(min(a, b))\n",
            _two_ints,
            lambda s: str(min(_ints_of(s))),
        ),
        _StdinFamily(
            "absdiff",
            pair.format(what="|a - b|"),
            read_pair + "print(abs(a - b))\n",
            _two_ints,
            lambda s: str(abs(_ints_of(s)[0] - _ints_of(s)[1])),
        ),
        _StdinFamily(
            "listsum",
            nums.format(what="their sum"),
            read_nums + "print(sum(xs))\n",
            _int_list,
            lambda s: str(sum(_ints_of(s)[1:])),
        ),
        _StdinFamily(
            "listmax",
            nums.format(what="the largest"),
            read_nums + "print(max(xs))\n",
            _int_list,
            lambda s: str(max(_ints_of(s)[1:])),
        ),
        _StdinFamily(
            "listmin",
            nums.format(what="the smallest"),
            read_nums + "print(min(xs))\n",
            _int_list,
            lambda s: str(min(_ints_of(s)[1:])),
        ),
        _StdinFamily(
            "evens",
            nums.format(what="how many are even"),
            read_nums + "print(sum(1 for x in xs if x % 2 == 0))\n",
            _int_list,
            lambda s: str(sum(1 for x in _ints_of(s)[1:] if x % 2 == 0)),
        ),
        _StdinFamily(
            "sorted",
            nums.format(what="them sorted ascending, space separated"),
            read_nums + "print(*sorted(xs))\n",
            _int_list,
            lambda s: " ".join(map(str, sorted(_ints_of(s)[1:]))),
        ),
        _StdinFamily(
            "reverse",
            word.format(what="it reversed"),
            "print(input().strip()[::-1])\n",
            _word,
            lambda s: s.strip()[::-1],
        ),
        _StdinFamily(
            "upper",
            word.format(what="it in upper case"),
            "print(input().strip().upper())\n",
            _word,
            lambda s: s.strip().upper(),
        ),
        _StdinFamily(
            "length",
            word.format(what="its length"),
            "print(len(input().strip()))\n",
            _word,
            lambda s: str(len(s.strip())),
        ),
        _StdinFamily(
            "vowels",
            word.format(what="how many vowels (aeiou) it has"),
            "print(sum(c in 'aeiou' for c in input().strip()))\n",
            _word,
            lambda s: str(sum(c in "aeiou" for c in s.strip())),
        ),
    ]
    for k in range(2, 10):
        fams.append(
            _StdinFamily(
                f"times{k}",
                f"Read an integer n from standard input and print n * {k}.",
                f"print(int(input()) * {k})\n",
                lambda rng: str(rng.randint(-100, 100)),
                functools.partial(_scaled, k=k),
            )
        )
        fams.append(
            _StdinFamily(
                f"plus{k}",
                f"Read an integer n from standard input and print n + {k}.",
                f"print(int(input()) + {k})\n",
                lambda rng: str(rng.randint(-100, 100)),
                functools.partial(_shifted, k=k),
            )
        )
    return fams


def _call_families() -> list[_CallFamily]:
    def ints(rng: random.Random) -> list[Any]:
        return [[rng.randint(-9, 30) for _ in range(rng.randint(0, 6))]]

    def text(rng: random.Random) -> list[Any]:
        return [_word(rng)]

    fams = [
        _CallFamily(
            "c_sum",
            "list_sum",
            "Write `list_sum(xs)` returning the sum of the list xs.",
            "def list_sum(xs):\n    return sum(xs)\n",
            ints,
            sum,
        ),
        _CallFamily(
            "c_len",
            "list_len",
            "Write `list_len(xs)` returning the number of items in xs.",
            "def list_len(xs):\n    return len(xs)\n",
            ints,
            len,
        ),
        _CallFamily(
            "c_rev",
            "reverse_list",
            "Write `reverse_list(xs)` returning xs in reverse order.",
            "def reverse_list(xs):\n    return xs[::-1]\n",
            ints,
            lambda xs: xs[::-1],
        ),
        _CallFamily(
            "c_sorted",
            "sort_list",
            "Write `sort_list(xs)` returning xs sorted ascending.",
            "def sort_list(xs):\n    return sorted(xs)\n",
            ints,
            sorted,
        ),
        _CallFamily(
            "c_evens",
            "only_evens",
            "Write `only_evens(xs)` returning the even items of xs in order.",
            "def only_evens(xs):\n    return [x for x in xs if x % 2 == 0]\n",
            ints,
            lambda xs: [x for x in xs if x % 2 == 0],
        ),
        _CallFamily(
            "c_pos",
            "count_positive",
            "Write `count_positive(xs)` returning how many items of xs are > 0.",
            "def count_positive(xs):\n    return sum(1 for x in xs if x > 0)\n",
            ints,
            lambda xs: sum(1 for x in xs if x > 0),
        ),
        _CallFamily(
            "c_srev",
            "reverse_text",
            "Write `reverse_text(s)` returning the string s reversed.",
            "def reverse_text(s):\n    return s[::-1]\n",
            text,
            lambda s: s[::-1],
        ),
        _CallFamily(
            "c_upper",
            "shout",
            "Write `shout(s)` returning s in upper case.",
            "def shout(s):\n    return s.upper()\n",
            text,
            str.upper,
        ),
        _CallFamily(
            "c_pal",
            "is_palindrome",
            "Write `is_palindrome(s)` returning True when s reads the same backwards.",
            "def is_palindrome(s):\n    return s == s[::-1]\n",
            text,
            lambda s: s == s[::-1],
        ),
        _CallFamily(
            "c_first",
            "first_char",
            "Write `first_char(s)` returning the first character of the non-empty string s.",
            "def first_char(s):\n    return s[0]\n",
            text,
            lambda s: s[0],
        ),
    ]
    for k in range(2, 12):
        fams.append(
            _CallFamily(
                f"c_scale{k}",
                f"scale_by_{k}",
                f"Write `scale_by_{k}(xs)` returning a list with every item of xs multiplied by {k}.",
                f"def scale_by_{k}(xs):\n    return [x * {k} for x in xs]\n",
                ints,
                lambda xs, k=k: [x * k for x in xs],
            )
        )
        fams.append(
            _CallFamily(
                f"c_add{k}",
                f"add_{k}",
                f"Write `add_{k}(n)` returning n + {k}.",
                f"def add_{k}(n):\n    return n + {k}\n",
                lambda rng: [rng.randint(-100, 100)],
                lambda n, k=k: n + k,
            )
        )
    return fams


def toy_problems(num_public: int = 2, num_private: int = 5, seed: int = 0) -> list[Problem]:
    """Every toy problem (stdin and call kinds), with `num_public` + `num_private` tests each."""
    problems: list[Problem] = []
    total = num_public + num_private
    for fam in _stdin_families():
        rng = random.Random(f"{seed}-{fam.name}")
        cases = [
            TestCase(inp, fam.answer(inp)) for inp in (fam.make_input(rng) for _ in range(total))
        ]
        problems.append(
            Problem(
                id=f"toy/{fam.name}",
                statement=fam.statement,
                test_kind=TestKind.STDIN,
                public_tests=tuple(cases[:num_public]),
                private_tests=tuple(cases[num_public:]),
                metadata={
                    "source": "toy",
                    "difficulty": "easy",
                    "reference_solution": fam.solution,
                },
            )
        )
    for cfam in _call_families():
        rng = random.Random(f"{seed}-{cfam.name}")
        cases = []
        for _ in range(total):
            args = cfam.make_args(rng)
            cases.append(
                TestCase("\n".join(json.dumps(a) for a in args), json.dumps(cfam.answer(*args)))
            )
        problems.append(
            Problem(
                id=f"toy/{cfam.name}",
                statement=cfam.statement,
                test_kind=TestKind.CALL,
                public_tests=tuple(cases[:num_public]),
                private_tests=tuple(cases[num_public:]),
                fn_name=cfam.fn_name,
                metadata={
                    "source": "toy",
                    "difficulty": "easy",
                    "reference_solution": cfam.solution,
                },
            )
        )
    return problems


def split_problems(
    problems: list[Problem], holdout_every: int = 5
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic train / held-out split: every `holdout_every`-th problem is held out."""
    train = [p for i, p in enumerate(problems) if i % holdout_every != holdout_every - 1]
    held = [p for i, p in enumerate(problems) if i % holdout_every == holdout_every - 1]
    return train, held


_ARITH_OPS = {
    "+": ("plus", lambda n, k: n + k),
    "-": ("minus", lambda n, k: n - k),
    "*": ("times", lambda n, k: n * k),
}


def arithmetic_problems(
    max_k: int = 99, num_public: int = 2, num_private: int = 3, seed: int = 0
) -> list[Problem]:
    """'Read n, print n <op> K' for K = 1..max_k and op in + - *: the learning demo's task.

    A tiny model can learn the program shape from a short warm start on some K; solving a new K
    needs copying it from the statement, which RL then sharpens.
    """
    problems = []
    total = num_public + num_private
    for symbol, (word, fn) in _ARITH_OPS.items():
        for k in range(1, max_k + 1):
            rng = random.Random(f"{seed}-arith-{word}-{k}")
            inputs = [rng.randint(-50, 50) for _ in range(total)]
            cases = [TestCase(str(n), str(fn(n, k))) for n in inputs]
            problems.append(
                Problem(
                    id=f"arith/{word}{k}",
                    statement=f"Read an integer n from standard input and print n {symbol} {k}.",
                    test_kind=TestKind.STDIN,
                    public_tests=tuple(cases[:num_public]),
                    private_tests=tuple(cases[num_public:]),
                    metadata={
                        "source": "arith",
                        "difficulty": word,
                        "reference_solution": f"print(int(input()) {symbol} {k})\n",
                    },
                )
            )
    return problems

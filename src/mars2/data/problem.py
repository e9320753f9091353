"""The one problem type every loader produces and every sandbox grades."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class TestKind(str, Enum):
    """How a problem's tests are run.

    ``stdin``: a program reads a test's input and prints its answer.
    ``call``: a function (or a LeetCode ``class Solution`` method) named ``fn_name`` gets one
    JSON-encoded argument per input line and returns the answer.
    ``humaneval``: each test is a Python source defining ``check(candidate)``, called on ``fn_name``.
    """

    STDIN = "stdin"
    CALL = "call"
    HUMANEVAL = "humaneval"


@dataclass(frozen=True)
class TestCase:
    """One test: its input (stdin text, JSON lines of arguments, or check source) and expected output."""

    input: str
    output: str

    __test__ = False  # not a pytest class, despite the name


@dataclass(frozen=True)
class Problem:
    """A code problem with public tests (shown to agents as feedback) and private tests (reward)."""

    id: str
    statement: str
    test_kind: TestKind
    public_tests: tuple[TestCase, ...]
    private_tests: tuple[TestCase, ...]
    starter_code: str = ""
    fn_name: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("problem id must be non-empty")
        if not self.private_tests and not self.public_tests:
            raise ValueError(f"problem {self.id!r} has no tests")
        if self.test_kind in (TestKind.CALL, TestKind.HUMANEVAL) and not self.fn_name:
            raise ValueError(f"problem {self.id!r}: {self.test_kind.value} tests need fn_name")

    @property
    def all_tests(self) -> tuple[TestCase, ...]:
        """Private tests, or the public ones where a source ships no private set."""
        return self.private_tests or self.public_tests

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; `Problem.from_dict` reverses it exactly."""
        data = asdict(self)
        data["test_kind"] = self.test_kind.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        """Rebuild a problem from `to_dict` output."""
        return cls(
            id=str(data["id"]),
            statement=str(data["statement"]),
            test_kind=TestKind(data["test_kind"]),
            public_tests=tuple(TestCase(**t) for t in data.get("public_tests", ())),
            private_tests=tuple(TestCase(**t) for t in data.get("private_tests", ())),
            starter_code=str(data.get("starter_code", "")),
            fn_name=data.get("fn_name"),
            metadata=dict(data.get("metadata", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


class ProblemFormatError(ValueError):
    """A dataset row that cannot become a `Problem`; names the file, line and field."""

    def __init__(self, source: str, line: int, field_name: str, message: str) -> None:
        self.source = source
        self.line = line
        self.field_name = field_name
        self.hint = ""
        super().__init__(f"{source}:{line}: field {field_name!r}: {message}")

    def add_hint(self, hint: str) -> None:
        """Say how to fix it, after the message (`str(error)` is then the whole paragraph)."""
        self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}. {self.hint}" if self.hint else text

"""Writes problems.jsonl (LiveCodeBench's row format) and candidates.jsonl next to this file.

Run ``python tests/data/lcb_corpus/build.py`` after editing; the test reads the jsonl files.

Every candidate is a whole model answer (fences and prose included) with the verdict LiveCodeBench
gives it (``lcb``), worked out from lcb_runner's documented rules (evaluation/testing_util.py,
compute_code_generation_metrics.py, utils/extraction_utils.py):

- extraction: the lines between the last two lines containing a triple backtick; none -> fails;
- verdict: every public and private test must pass (it stops at the first failure);
- prelude: ``from typing/collections/math/heapq/bisect/itertools/functools/operator/... import *``
  plus the plain module names, and ``sys.setrecursionlimit(50000)``;
- stdin: outputs stripped and split into lines, each line equal or equal as Decimal tokens; any
  SystemExit after printing is ignored; sys.stdin becomes a StringIO (no .buffer) and the real
  stdin's read/readline/readlines are patched too; builtins.open is mocked, but the prelude's
  `from builtins import *` already bound the real open; the user's code runs as the body of a
  function, its imports hoisted to module level (run before stdout is captured);
- call: ``Solution()`` (one instance for all tests) when the text "class Solution" occurs, else the
  module; a returned tuple becomes a list (top level only), then ``==`` against the JSON output;
- limits: 6 s per test, the whole answer bounded by (6 + 1) * tests + 5 s, the int/str digit limit
  raised to 50000 (compute_code_generation_metrics.py), builtins.quit set to None.

``mars2`` is given only where mars2 deliberately differs (an LCB artefact that is plainly wrong);
``why`` says which rule decides. scripts/lcb_side_by_side.py checks every ``lcb`` verdict against
LiveCodeBench's own code (nvidia-livecodebench 26.3: all 69 as written).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _long_str(value: int) -> str:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return str(value)
    finally:
        sys.set_int_max_str_digits(before)


def _tests(pairs: list[tuple[str, str]], kind: str) -> str:
    return json.dumps([{"input": i, "output": o, "testtype": kind} for i, o in pairs])


def stdin_problem(qid: str, content: str, public: list, private: list) -> dict[str, Any]:
    return {
        "question_id": qid,
        "question_title": qid,
        "question_content": content,
        "platform": "atcoder",
        "contest_date": "2025-02-01T00:00:00",
        "difficulty": "easy",
        "starter_code": "",
        "public_test_cases": _tests(public, "stdin"),
        "private_test_cases": _tests(private, "stdin"),
        "metadata": "{}",
    }


def call_problem(
    qid: str, content: str, fn: str, signature: str, public: list, private: list
) -> dict[str, Any]:
    return {
        "question_id": qid,
        "question_title": qid,
        "question_content": content,
        "platform": "leetcode",
        "contest_date": "2025-03-01T00:00:00",
        "difficulty": "medium",
        "starter_code": f"class Solution:\n    def {fn}(self, {signature}:\n        ",
        "public_test_cases": _tests(public, "functional"),
        "private_test_cases": _tests(private, "functional"),
        "metadata": json.dumps({"func_name": fn}),
    }


PROBLEMS = [
    stdin_problem(
        "sum",
        "Given integers A and B, print A + B.",
        [("1 2\n", "3\n"), ("10 20\n", "30\n")],
        [("-5 3\n", "-2\n"), ("100 200\n", "300\n"), ("7 -7\n", "0\n")],
    ),
    stdin_problem(
        "tokens",
        "The first line holds N, the second N integers. Print their sum.",
        [("3\n1 2 3\n", "6\n")],
        [("5\n10 20 30 40 50\n", "150\n"), ("1\n-4\n", "-4\n")],
    ),
    stdin_problem(
        "half",
        "Given an integer X, print X / 2.",
        [("5\n", "2.5\n")],
        [("7\n", "3.5\n"), ("4\n", "2\n")],
    ),
    stdin_problem(
        "parity",
        "Print Yes if N is even, else No.",
        [("4\n", "Yes\n")],
        [("7\n", "No\n")],
    ),
    stdin_problem(
        "power",
        "Print 2 to the power N.",
        [("10\n", "1024\n")],
        [("13000\n", str(2**13000) + "\n"), ("30000\n", _long_str(2**30000) + "\n")],
    ),
    stdin_problem(
        "digitsum",
        "N has up to 5000 digits. Print the sum of its digits.",
        [("12345\n", "15\n")],
        [("9" * 5000 + "\n", "45000\n")],
    ),
    stdin_problem(
        "hugedigits",
        "N has up to 60000 digits. Print the sum of its digits.",
        [("12345\n", "15\n")],
        [("9" * 60000 + "\n", "540000\n")],
    ),
    stdin_problem(
        "long",
        "Given K, print 2K. (Twelve tests; each answer below spends 0.35 s of CPU per test.)",
        [(f"{k}\n", f"{2 * k}\n") for k in range(2)],
        [(f"{k}\n", f"{2 * k}\n") for k in range(2, 12)],
    ),
    call_problem(
        "sumList",
        "Return the sum of nums.",
        "sumList",
        "nums: List[int]) -> int",
        [("[1, 2, 3]", "6")],
        [("[10, -10, 5]", "5"), ("[]", "0")],
    ),
    call_problem(
        "pairUp",
        "Return [[nums[0], nums[1]], [nums[2], nums[3]], ...].",
        "pairUp",
        "nums: List[int]) -> List[List[int]]",
        [("[1, 2, 3, 4]", "[[1, 2], [3, 4]]")],
        [("[5, 6]", "[[5, 6]]")],
    ),
    call_problem(
        "addAll",
        "Return the sum of the floats in nums, as a float.",
        "addAll",
        "nums: List[float]) -> float",
        [("[0.5, 0.25]", "0.75")],
        [("[0.1, 0.2]", "0.3")],
    ),
    call_problem(
        "isEven",
        "Return whether n is even.",
        "isEven",
        "n: int) -> bool",
        [("4", "true")],
        [("7", "false")],
    ),
    call_problem(
        "chainLength",
        "Return n, computed by a chain of n nested calls.",
        "chainLength",
        "n: int) -> int",
        [("10", "10")],
        [("20000", "20000")],
    ),
    call_problem(
        "splitAt",
        "Return [s[:k], s[k:]].",
        "splitAt",
        "s: str, k: int) -> List[str]",
        [('"abcdef"\n2', '["ab", "cdef"]')],
        [('"xy"\n0', '["", "xy"]')],
    ),
    call_problem(
        "countLetters",
        "Return a mapping from each letter of s to its count.",
        "countLetters",
        "s: str) -> Dict[str, int]",
        [('"aab"', '{"a": 2, "b": 1}')],
        [('"z"', '{"z": 1}')],
    ),
]


def fence(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code.strip()}\n```\n"


SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
TOKENS_TAIL = "n = int(data[0])\nprint(sum(map(int, data[1:1 + n])))\n"
BURN = (
    "import time\n"
    "k = int(input())\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.35:\n"
    "    pass\n"
    "print(2 * k)\n"
)


def solution(body: str, fn: str = "sumList", args: str = "nums") -> str:
    return f"class Solution:\n    def {fn}(self, {args}):\n" + "".join(
        f"        {line}\n" for line in body.strip().split("\n")
    )


# (problem, class, completion, lcb verdict, mars2 verdict or None, why)
CANDIDATES: list[tuple[str, str, str, str, str | None, str]] = [
    # --- which tests decide ------------------------------------------------------------------
    ("sum", "tests", fence(SUM), "pass", None, "right on every test"),
    ("sum", "tests", fence("a, b = map(int, input().split())\nprint(abs(a) + abs(b))"), "fail",
     None, "passes the public tests, fails a private one"),
    ("sum", "tests", fence("a, b = map(int, input().split())\nprint(0 if a == 1 else a + b)"),
     "fail", None, "passes every private test but fails a public one: public tests count too"),
    # --- the import prelude -----------------------------------------------------------------
    ("sumList", "prelude", fence(solution("return sum(nums)", args="nums: List[int]")),
     "pass", None, "List comes from the prelude's `from typing import *`"),
    ("sumList", "prelude", fence(solution(
        "c = Counter(nums)\nbest = -inf\nreturn sum(k * v for k, v in c.items())",
        args="nums: List[int]")), "pass", None, "Counter and inf come from the prelude"),
    ("tokens", "prelude", fence("n = int(input())\nxs = list(map(int, input().split()))\n"
                                "print(list(accumulate(xs, add))[-1])"),
     "pass", None, "accumulate and add come from the prelude"),
    ("half", "prelude", fence("x = int(input())\nprint(pow(x, 1, 10**9) / 2)"), "pass", None,
     "three-argument pow: `from builtins import *` undoes `from math import *`'s pow"),
    ("sumList", "prelude", fence(solution("return sum(nums)", args="nums: List[int]") +
                                 "\nprint(sqrt(16), gcd(4, 6), comb(5, 2), heappush, bisect_left)"),
     "pass", None, "math, heapq and bisect names come from the prelude"),
    ("tokens", "prelude", fence("input()\nprint(int(np.sum(np.array(input().split(), dtype=int))))"),
     "fail", None, "numpy is not part of the prelude"),
    # --- comparing call results -------------------------------------------------------------
    ("pairUp", "call", fence(solution("return [[nums[i], nums[i + 1]] for i in range(0, len(nums), 2)]",
                                      "pairUp")), "pass", None, "lists of lists"),
    ("pairUp", "call", fence(solution("return [(nums[i], nums[i + 1]) for i in range(0, len(nums), 2)]",
                                      "pairUp")), "fail", None,
     "only a top-level tuple becomes a list: [(1, 2)] != [[1, 2]]"),
    ("pairUp", "call", fence(solution(
        "return tuple([nums[i], nums[i + 1]] for i in range(0, len(nums), 2))", "pairUp")),
     "pass", None, "a returned tuple becomes a list"),
    ("addAll", "call", fence(solution("return sum(nums)", "addAll")), "fail", None,
     "exact ==: 0.1 + 0.2 != 0.3, no float tolerance"),
    ("addAll", "call", fence(solution("return round(sum(nums), 9)", "addAll")), "pass", None,
     "exactly the expected floats"),
    ("isEven", "call", fence(solution("return int(n % 2 == 0)", "isEven", "n")), "pass", None,
     "1 == True and 0 == False in Python"),
    ("isEven", "call", fence(solution("return 'true' if n % 2 == 0 else 'false'", "isEven", "n")),
     "fail", None, "a string is not a bool"),
    ("sumList", "call", fence(solution("return [sum(nums)]")), "fail", None,
     "a one-item list is not the bare value"),
    ("sumList", "call", fence(solution("return float(sum(nums))")), "pass", None,
     "6.0 == 6 in Python"),
    ("splitAt", "call", fence(solution("return s[:k], s[k:]", "splitAt", "s, k")), "pass", None,
     "two arguments, one JSON value per line; a tuple return becomes a list"),
    ("countLetters", "call", fence(
        "from collections import Counter\n" + solution("return Counter(s)", "countLetters", "s")),
     "pass", None, "a Counter equals the dict with the same keys"),
    ("countLetters", "call", fence(solution(
        "out = {}\nfor c in s:\n    out[ord(c)] = out.get(ord(c), 0) + 1\nreturn out",
        "countLetters", "s")), "fail", None, "int keys never equal JSON's string keys"),
    ("sumList", "call", fence("import numpy as np\n" + solution("return np.int64(sum(nums))")),
     "pass", None, "a numpy integer equals the int"),
    ("pairUp", "call", fence("import numpy as np\n" + solution(
        "return np.array(nums).reshape(-1, 2)", "pairUp")), "fail", None,
     "a numpy array is not a list (in LCB its == is ambiguous: a runtime error)"),
    ("sumList", "call", fence("class Solution:\n    pass\n\n\ndef sumList(nums):\n    return sum(nums)\n"),
     "fail", None, "class Solution exists: the method is looked up there only"),
    ("sumList", "call", fence("def sumList(nums):\n    return sum(nums)\n"), "pass", None,
     "no class Solution in the code: the module-level function is used"),
    ("sumList", "call", fence("# class Solution is not needed here\ndef sumList(nums):\n"
                              "    return sum(nums)\n"), "fail", None,
     "the text 'class Solution' occurs, so Solution() is required"),
    ("sumList", "call", fence("class Solution:\n    def __init__(self):\n        self.total = 0\n\n"
                              "    def sumList(self, nums):\n        self.total += sum(nums)\n"
                              "        return self.total\n"), "fail", None,
     "one Solution() serves every test, so state carries over"),
    # --- limits -------------------------------------------------------------------------------
    ("chainLength", "limits", fence(solution(
        "def go(k):\n    return 0 if k == 0 else 1 + go(k - 1)\nreturn go(n)", "chainLength", "n")),
     "pass", None, "recursion limit 50000 from the prelude"),
    ("digitsum", "limits", fence("n = int(input())\nprint(sum(int(c) for c in str(n)))"), "pass",
     None, "int() of 5000 digits: LCB raises the 4300-digit default to 50000"),
    ("hugedigits", "limits", fence("n = int(input())\nprint(sum(int(c) for c in str(n)))"),
     "fail", None, "int() of 60000 digits exceeds the 50000-digit limit"),
    ("hugedigits", "limits", fence("print(sum(map(int, input().strip())))"), "pass", None,
     "no int conversion of the long number"),
    ("power", "limits", fence("print(2 ** int(input()))"), "pass", None,
     "9031 digits printed: under the 50000-digit limit"),
    ("sum", "limits", fence(SUM + "import sys\nsys.exit(1)"), "pass", None,
     "stdin: SystemExit after the output is ignored, whatever its code"),
    ("sum", "limits", fence(SUM + "raise SystemExit('done')"), "pass", None,
     "stdin: SystemExit after the output is ignored"),
    ("sumList", "limits", fence("import sys\n" + solution("sys.exit(0)")), "fail", None,
     "call: SystemExit is not caught, the run ends without results"),
    ("long", "limits", fence(BURN), "pass", None,
     "no whole-answer cap beyond (timeout + 1) * tests + 5 s"),
    ("sum", "limits", fence("while True:\n    pass"), "fail", None, "time limit per test"),
    ("sum", "limits", fence(SUM + "print(1 // 0)"), "fail", None,
     "an exception after the right output is a runtime error"),
    # --- code extraction ----------------------------------------------------------------------
    ("sum", "extraction", fence(SUM) + "Sample run:\n```text\n3\n```\n", "fail", None,
     "the last two fence lines hold the text block, whatever its tag"),
    ("sum", "extraction", fence(SUM) + "Or shorter:\n```python\nprint(sum(map(int,\n```\n",
     "fail", None, "the last block is taken even when it does not parse"),
    ("sum", "extraction", "```python\n" + SUM, "fail", None,
     "an unclosed fence is one fence line: no code"),
    ("sum", "extraction", SUM, "fail", None, "no fences: no code"),
    ("sum", "extraction", fence(SUM, "cpp"), "pass", None, "the language tag is ignored"),
    ("sum", "extraction", fence("print(0)") + "Better:\n" + fence(SUM), "pass", None,
     "the last block wins"),
    ("sum", "extraction", fence(SUM) + "\nThis reads A and B and prints their sum.\n", "pass",
     None, "prose after the block is ignored"),
    ("sum", "extraction", "Answer: ```python\n" + SUM + "``` (done)\n", "pass", None,
     "any line containing ``` is a fence line"),
    # --- comparing standard output ----------------------------------------------------------
    ("half", "stdout", fence("print(f'{int(input()) / 2:.2f}')"), "pass", None,
     "2.50 equals 2.5 as a Decimal"),
    ("half", "stdout", fence("print(int(input()) / 2 + 1e-6)"), "fail", None,
     "no tolerance: 2.500001 != 2.5"),
    ("sum", "stdout", fence("a, b = map(int, input().split())\nprint('  ', a + b, '  ')\nprint()\n"
                            "print()"), "pass", None, "surrounding whitespace and blank lines"),
    ("sum", "stdout", fence("a, b = map(int, input().split())\nprint(f'{a + b}e0')"), "pass", None,
     "'3e0' equals '3' as a Decimal"),
    ("parity", "stdout", fence("print('YES' if int(input()) % 2 == 0 else 'NO')"), "fail", None,
     "case matters"),
    ("tokens", "stdout", fence("input()\nprint(sum(map(int, input().split())))\nprint('done')"),
     "fail", None, "an extra line"),
    ("tokens", "stdout", fence("import sys\ndata = sys.stdin.read().split()\n" + TOKENS_TAIL),
     "pass", None, "sys.stdin.read"),
    ("tokens", "stdout", fence("from sys import stdin\nn = int(stdin.readline())\n"
                               "print(sum(map(int, stdin.readline().split())))"), "pass", None,
     "the real stdin's read/readline/readlines are patched too, so a hoisted import works"),
    ("tokens", "stdout", fence("import sys\ninput = sys.stdin.readline\nn = int(input())\n"
                               "print(sum(map(int, input().split())))"), "pass", None,
     "sys.stdin.readline"),
    ("tokens", "stdout", fence("import sys\nlines = []\nwhile True:\n    line = sys.stdin.readline()\n"
                               "    if not line:\n        break\n    lines.append(line)\n"
                               "print(sum(map(int, lines[1].split())))"), "pass", None,
     "readline until an empty string: the input's final newline gives one"),
    ("sum", "stdout", fence("import sys\na, b = map(int, input().split())\nsys.stdout.write(f'{a + b}\\n')"),
     "pass", None, "sys.stdout.write"),
    ("sum", "stdout", fence(SUM + "exit()"), "pass", None, "exit() after the output"),
    ("tokens", "stdout", fence("import sys\ndata = []\nfor line in sys.stdin:\n"
                               "    data += line.split()\n" + TOKENS_TAIL), "pass", None,
     "iterating over sys.stdin"),
    ("sum", "stdout", fence("def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n\n"
                            "if __name__ == '__main__':\n    main()"), "pass", None,
     "a final __main__ guard runs"),
    # --- LiveCodeBench artefacts mars2 does not reproduce -------------------------------------
    ("tokens", "artefact", fence("import sys\ninput = sys.stdin.buffer.readline\nn = int(input())\n"
                                 "print(sum(map(int, input().split())))"), "fail", "pass",
     "LCB's sys.stdin is a StringIO without .buffer"),
    ("tokens", "artefact", fence("data = open(0).read().split()\n" + TOKENS_TAIL), "fail", "pass",
     "LCB's prelude binds the real open (from builtins import *) before it mocks builtins.open"),
    ("sum", "artefact", fence("from sys import stdout\na, b = map(int, input().split())\n"
                              "stdout.write(str(a + b) + '\\n')"), "fail", "pass",
     "LCB hoists imports: `from sys import stdout` binds the real stdout, not its capture"),
    ("sum", "artefact", fence("def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n\n"
                              "if __name__ == '__main__':\n    main()\nx = 1"), "fail", "pass",
     "LCB only unwraps a __main__ guard that is the last statement; elsewhere __name__ is not __main__"),
    ("tokens", "artefact", fence("import os\ndata = os.read(0, 1 << 20).split()\n" + TOKENS_TAIL),
     "fail", "pass", "LCB never puts the input on file descriptor 0"),
    ("sum", "artefact", fence("total = 0\n\n\ndef add(x):\n    global total\n    total += x\n\n\n"
                              "for v in map(int, input().split()):\n    add(v)\nprint(total)"),
     "fail", "pass", "LCB runs the code as a function body, so `global` names are missing"),
    ("sum", "artefact", fence(SUM + "quit()"), "fail", "pass", "LCB sets builtins.quit to None"),
    ("sum", "artefact", fence(SUM + "import os\nos._exit(0)"), "fail", "pass",
     "os._exit ends LCB's whole grading process, so no result is recorded"),
    ("sumList", "artefact", fence("class Anything:\n    def __eq__(self, other):\n        return True\n\n\n"
                                  + solution("return Anything()")), "pass", "fail",
     "LCB compares in the answer's process, so the answer's own __eq__ decides"),
]  # fmt: skip


def main() -> None:
    with open(HERE / "problems.jsonl", "w", encoding="utf-8") as handle:
        for row in PROBLEMS:
            handle.write(json.dumps(row) + "\n")
    with open(HERE / "candidates.jsonl", "w", encoding="utf-8") as handle:
        for index, (problem, cls, completion, lcb, ours, why) in enumerate(CANDIDATES):
            row = {"id": f"{index:02d}-{problem}-{cls}", "problem": problem, "class": cls,
                   "completion": completion, "lcb": lcb, "why": why}  # fmt: skip
            if ours is not None:
                row["mars2"] = ours
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

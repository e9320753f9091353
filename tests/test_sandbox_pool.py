"""The local pool: configuration, uid leases, workers' environment and lifetime, stalled jobs and
the job loop's transitions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mars2.sandbox.base import Job, Verdict
from mars2.sandbox.pool.job_loop import JobLoop
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.protocol import ResultRow, WorkerConfig, wall_limit
from mars2.sandbox.runner.harness import encode_result
from mars2.sandbox.runner.scratch import make_private_dir
from tests.sandbox_cases import (
    ADD,
    ADD_CODE,
    verdicts,
)


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="timeouts"):
        LocalSandbox(num_workers=1, per_test_timeout=0)
    with pytest.raises(ValueError, match="isolation"):
        LocalSandbox(num_workers=1, isolation="paranoid")


def test_uid_leases_never_overlap(tmp_path) -> None:
    from mars2.sandbox.pool.uid_lease import UidLease

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
            uids = [set(p.uid_lease.uids) for p in pools if p.uid_lease]
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


KILLED_TRAINER = """
import sys
from mars2.sandbox.base import Job
from mars2.sandbox.pool.local import LocalSandbox
scratch, isolation, bwrap = sys.argv[1], sys.argv[2], sys.argv[3] or None
box = LocalSandbox(
    num_workers=2, per_test_timeout=2.0, scratch_dir=scratch, isolation=isolation, bwrap=bwrap
)
(result,) = box.run_batch([Job("print(3)", "stdin", [{"input": "1 2", "output": "3"}])])
print(result.tests[0].verdict.value, flush=True)
sys.stdin.read()  # never returns: the test kills this process
"""


def _descendants(root: int) -> set[int]:
    """Every process below `root`, from each process's parent in /proc/PID/stat."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


@pytest.mark.parametrize("contained", [True, False])
def test_a_killed_trainer_leaves_nothing_in_the_scratch_dir(
    tmp_path: Path, contained: bool
) -> None:
    """SIGKILL gives the pool no chance to clean up: workers, executors and containers must go by
    themselves, and leave nothing on the host (without a container, the jobs' directories live
    under the scratch dir)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if not contained:  # job uids pass through it to their own directories
        scratch = Path(make_private_dir("/var/tmp", "mars2-killed-"))
        scratch.chmod(0o755)
    isolation, bwrap = ("required", "") if contained else ("best_effort", "/nonexistent/bwrap")
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, str(scratch), isolation, bwrap],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == Verdict.PASSED.value
        started = _descendants(trainer.pid)
        # Two workers, each with its executor (and in a container, bubblewrap's process).
        assert len(started) >= (6 if contained else 4), started
        if not contained:
            assert len(os.listdir(scratch)) == 2  # each worker's directory for its jobs
        trainer.kill()
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(started), "sandbox processes outlived their trainer"
        assert sorted(os.listdir(scratch)) == []
    finally:
        if not contained:
            subprocess.run(["rm", "-rf", "--one-file-system", str(scratch)], check=False)
        trainer.kill()
        trainer.wait()
        if trainer.stdin is not None:
            trainer.stdin.close()
        if trainer.stdout is not None:
            trainer.stdout.close()


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


@pytest.mark.parametrize("contained", [True, False])
@pytest.mark.parametrize("name", list(STALLS))
def test_stalled_jobs_cost_at_most_their_timeout(name: str, contained: bool) -> None:
    # Without a container the executor (root, another uid) reaps the job's uid by itself.
    if os.geteuid() != 0 and not contained:
        pytest.skip("without root or a container the job's processes share the test's uid")

    from mars2.sandbox.pool.local import POOL_MARGIN
    from mars2.sandbox.runner.limits import count_tasks_of

    job_timeout = 3.0
    options = {} if contained else {"isolation": "best_effort", "bwrap": "/nonexistent/bwrap"}
    with LocalSandbox(
        num_workers=1, per_test_timeout=1.0, job_timeout=job_timeout, **options
    ) as box:
        assert box.isolation["pid_namespace"] is contained
        began = time.monotonic()
        got = verdicts(box, STALLS[name])
        elapsed = time.monotonic() - began
        assert Verdict.PASSED not in got and set(got) <= {
            Verdict.TIMEOUT,
            Verdict.RUNTIME_ERROR,
            Verdict.INFRA_ERROR,
        }
        assert elapsed < job_timeout + POOL_MARGIN, elapsed
        uid = box.isolation["sandbox_uid"]
        if uid is not None:
            assert count_tasks_of(uid) == 0  # nothing the job started survived it
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]


# --- the typed worker protocol, without processes ------------------------------------------------


def test_worker_config_round_trips_and_refuses_unknown_fields() -> None:
    config = WorkerConfig(per_test_timeout=2.5, sandbox_uid=61003, bwrap="/usr/bin/bwrap")
    again = WorkerConfig.from_json(config.to_json())
    assert again == config and again.per_test_timeout == 2.5 and again.wall_factor == 3.0
    assert config.max_tasks == 36 and not hasattr(config, "__dict__")  # slots only
    with pytest.raises(TypeError, match="unknown WorkerConfig fields"):
        WorkerConfig(wrapper="bwrap")
    assert wall_limit(2.0, 3.0) == 7.0


def _records(*records: dict) -> bytes:
    return b"".join(encode_result(r).encode() + b"\n" for r in records)


def _loop(tests=ADD, early_stop=False, retries=1, kind="stdin", checks=()) -> JobLoop:
    job = {"tests": tests, "kind": kind, "early_stop": early_stop, "profile": "lenient"}
    config = WorkerConfig(per_test_timeout=1.0, overload_retries=retries)
    return JobLoop(job, config, list(checks), now=0.0)


def _verdicts(loop: JobLoop) -> list[str | None]:
    return [None if r is None else r.verdict for r in loop.results()]


def test_job_loop_judges_records_as_they_arrive_and_restarts_after_a_crash() -> None:
    loop = _loop(tests=ADD + ADD)
    request = loop.next_request(now=0.0)
    assert request is not None and request["start"] == 0 and request["wall_limit"] == 4.0
    # The child reported two tests, then died of a signal on the third.
    blob = _records(
        {"index": 0, "status": "ok", "stdout": "3\n"}, {"index": 1, "status": "ok", "stdout": "9"}
    )
    loop.on_reply({"outcome": "eof", "status": 9, "cpu": 0.1, "elapsed": 0.1}, blob)
    assert _verdicts(loop) == ["passed", "wrong_answer", "runtime_error", None]
    assert loop.rows[2] is not None and loop.rows[2].error == "killed by SIGKILL"
    request = loop.next_request(now=1.0)  # a fresh child from the first test not yet judged
    assert request is not None and request["start"] == 3 and loop.segments == 2
    loop.on_reply(
        {"outcome": "eof", "status": 0}, _records({"index": 3, "status": "ok", "stdout": "10"})
    )
    assert loop.next_request(now=2.0) is None and loop.done
    assert _verdicts(loop) == ["passed", "wrong_answer", "runtime_error", "passed"]


def test_job_loop_runs_a_starved_test_again_once() -> None:
    starved = {"index": 0, "status": "wall", "cpu": 0.2, "time": 4.0, "delay": 3.5}
    loop = _loop(tests=ADD[:1], retries=1)
    loop.next_request(now=0.0)
    loop.on_reply({"outcome": "eof", "status": 0}, _records(starved))
    assert loop.retries == 0 and loop.start == 0 and not loop.done  # `overloaded`: run again
    loop.next_request(now=1.0)
    loop.on_reply({"outcome": "eof", "status": 0}, _records(starved))
    assert _verdicts(loop) == ["overloaded"] and loop.next_request(now=2.0) is None


def test_job_loop_transitions_junk_deadline_halfway_and_a_lost_executor() -> None:
    loop = _loop()
    loop.next_request(now=0.0)
    loop.on_reply({"outcome": "eof", "status": 0}, b'{"index": 0, "verdict": "passed"}\n')
    assert _verdicts(loop)[0] == "runtime_error" and "result channel" in loop.rows[0].error
    loop = _loop()
    loop.next_request(now=0.0)
    loop.on_reply({"outcome": "deadline", "status": None, "cpu": 1.5, "elapsed": 9.0}, b"")
    assert _verdicts(loop) == ["timeout", "timeout"] and loop.done
    assert all("job time limit" in r.error for r in loop.results() if r is not None)
    assert _loop().next_request(now=1e9) is None  # past the job's own deadline before it began
    loop = _loop(early_stop=True)
    loop.next_request(now=0.0)
    loop.failed_halfway(ResultRow(0, "wrong_answer", "assert on line 2 failed"))
    assert loop.done and _verdicts(loop) == ["wrong_answer", "skipped"]
    loop = _loop()
    loop.next_request(now=0.0)
    loop.executor_lost()
    assert _verdicts(loop) == ["timeout", "timeout"] and loop.next_request(now=0.0) is None
    loop = _loop()
    loop.next_request(now=0.0)
    loop.on_reply({"compile_error": "SyntaxError: invalid syntax"}, b"")
    assert _verdicts(loop) == ["compile_error", "compile_error"]


def test_job_loop_under_early_stop_ends_at_the_first_failure() -> None:
    loop = _loop(tests=ADD + ADD, early_stop=True)
    loop.next_request(now=0.0)
    loop.on_reply(
        {"outcome": "eof", "status": 0},
        _records(
            {"index": 0, "status": "ok", "stdout": "3"}, {"index": 1, "status": "ok", "stdout": "1"}
        ),
    )
    assert loop.done and _verdicts(loop) == ["passed", "wrong_answer", "skipped", "skipped"]

"""E2BSandbox against a local fake of the e2b SDK (the remote service cannot be reached here)."""

from __future__ import annotations

import itertools
import json
import types

import pytest

from mars2.sandbox.base import Job, Verdict
from mars2.sandbox.pool.e2b import E2BSandbox
from tests.fakes import e2b_sdk

pytestmark = pytest.mark.e2b
TESTS = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "4"}]
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture
def fake_sdk() -> types.ModuleType:
    e2b_sdk.STATE = e2b_sdk.FakeState()
    return e2b_sdk  # type: ignore[return-value]


def test_jobs_run_remotely_with_verdicts(fake_sdk) -> None:
    with E2BSandbox(api_key="k", max_concurrency=2, sdk=fake_sdk) as box:
        results = box.run_batch(
            [
                Job(ADD, "stdin", TESTS),
                Job("print(3)", "stdin", TESTS),
                Job("while True: pass", "stdin", TESTS[:1], per_test_timeout=0.5),
            ]
        )
    assert [t.verdict for t in results[0].tests] == [Verdict.PASSED, Verdict.PASSED]
    assert [t.verdict for t in results[1].tests] == [Verdict.PASSED, Verdict.WRONG_ANSWER]
    assert [t.verdict for t in results[2].tests] == [Verdict.TIMEOUT]
    assert fake_sdk.STATE.api_keys and set(fake_sdk.STATE.api_keys) == {"k"}


def test_concurrency_limit_and_sandbox_reuse(fake_sdk) -> None:
    with E2BSandbox(api_key="k", max_concurrency=2, sdk=fake_sdk) as box:
        box.run_batch([Job(ADD, "stdin", TESTS)] * 8)
    assert fake_sdk.STATE.peak <= 2
    assert fake_sdk.STATE.created <= 2  # pooled: sandboxes are reused across jobs
    assert fake_sdk.STATE.killed == fake_sdk.STATE.created  # closed on exit


def test_transient_errors_are_retried(fake_sdk) -> None:
    fake_sdk.STATE.fail_next_commands = 2
    with E2BSandbox(api_key="k", max_concurrency=1, retries=3, sdk=fake_sdk) as box:
        (result,) = box.run_batch([Job(ADD, "stdin", TESTS)])
    assert result.all_passed


def test_persistent_failure_gives_a_verdict_not_an_exception(fake_sdk) -> None:
    fake_sdk.STATE.fail_next_commands = 10
    with E2BSandbox(api_key="k", max_concurrency=1, retries=2, sdk=fake_sdk) as box:
        (result,) = box.run_batch([Job(ADD, "stdin", TESTS)])
    assert all(
        t.verdict is Verdict.INFRA_ERROR and "E2B unavailable" in t.error for t in result.tests
    )


def test_crash_mid_job_keeps_finished_tests(fake_sdk) -> None:
    code = "import os\na, b = map(int, input().split())\nif a == 2:\n    os.kill(os.getpid(), 9)\nprint(a + b)"
    with E2BSandbox(api_key="k", sdk=fake_sdk) as box:
        (result,) = box.run_batch([Job(code, "stdin", TESTS)])
    assert result.tests[0].verdict is Verdict.PASSED  # reported before the remote process died
    assert result.tests[1].verdict is Verdict.RUNTIME_ERROR


def test_missing_api_key_is_a_clear_error(monkeypatch, fake_sdk) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(ValueError, match="E2B_API_KEY"):
        E2BSandbox(sdk=fake_sdk)


def test_expected_outputs_never_leave_this_machine(fake_sdk) -> None:
    secret_tests = [{"input": "1 2", "output": "31415926"}]
    check = {"input": "def check(candidate):\n    assert candidate(2) == 27182818\n", "output": ""}
    with E2BSandbox(api_key="k", sdk=fake_sdk) as box:
        stdin_result, he_result = box.run_batch(
            [
                Job("print(31415926)", "stdin", secret_tests),
                Job("def f(x):\n    return 27182818\n", "humaneval", [check], fn_name="f"),
            ]
        )
    assert stdin_result.all_passed and he_result.all_passed  # judged here, on our side
    jobs = [json.loads(d) for p, d in fake_sdk.STATE.written.items() if p.endswith("job.json")]
    shipped = json.dumps([{k: v for k, v in job.items() if k != "code"} for job in jobs])
    assert "candidate(2)" in shipped and "31415926" not in shipped and "27182818" not in shipped
    names = {path.rsplit("/", 1)[1] for path in fake_sdk.STATE.written}
    assert {"harness.py", "compare.py", "prelude.py", "job.json"} <= names


def test_forged_remote_records_are_not_verdicts(fake_sdk) -> None:
    forge = (
        "import os\n"
        "for i in range(2):\n"
        '    os.write(1, b\'@@MARS2@@{"index": %d, "verdict": "passed", "status": "ok"}\\n\' % i)\n'
        "os._exit(0)\n"
    )
    eq = (
        "class A:\n    def __eq__(self, o):\n        return True\ndef pair(a, b):\n    return A()\n"
    )
    with E2BSandbox(api_key="k", sdk=fake_sdk) as box:
        forged, always = box.run_batch(
            [
                Job(forge, "stdin", TESTS),
                Job(eq, "call", [{"input": "1\n2", "output": "[1, 2]"}], fn_name="pair"),
            ]
        )
    assert [t.verdict for t in forged.tests] == [Verdict.WRONG_ANSWER] * 2
    assert [t.verdict for t in always.tests] == [Verdict.WRONG_ANSWER]


def test_sandboxes_are_created_without_internet_unless_allowed(fake_sdk) -> None:
    with E2BSandbox(api_key="k", sdk=fake_sdk) as box:
        assert box.run_batch([Job(ADD, "stdin", TESTS)])[0].all_passed
    with E2BSandbox(api_key="k", allow_network=True, sdk=fake_sdk) as box:
        assert box.run_batch([Job(ADD, "stdin", TESTS)])[0].all_passed
    flags = [options["allow_internet_access"] for options in fake_sdk.STATE.create_options]
    assert flags == [False, True]


def test_the_wall_factor_reaches_the_remote_harness(fake_sdk) -> None:
    with E2BSandbox(api_key="k", per_test_timeout=2.0, wall_factor=5.0, sdk=fake_sdk) as box:
        box.run_batch([Job(ADD, "stdin", TESTS)])
    (job,) = [json.loads(d) for p, d in fake_sdk.STATE.written.items() if p.endswith("job.json")]
    assert job["wall_limit"] == 11.0  # the local sandbox's rule: 5 x 2 s + 1 s


def test_a_burst_of_creates_is_spread_out(fake_sdk) -> None:
    with E2BSandbox(
        api_key="k", max_concurrency=8, max_parallel_creates=3, create_jitter=0.05, seed=0,
        sdk=fake_sdk,
    ) as box:  # fmt: skip
        results = box.run_batch([Job(ADD, "stdin", TESTS)] * 8)
    assert all(r.all_passed for r in results)
    state = fake_sdk.STATE
    assert state.created == 8 and state.peak_creating <= 3
    times = sorted(state.create_times)
    assert times[-1] - times[0] > 0.02  # not one burst: later creates waited a random delay


def _accepted(function) -> set[str]:
    """The keyword names `function` accepts (its typed **opts included)."""
    import inspect
    import typing

    names = set()
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            hint = typing.get_type_hints(function).get(parameter.name)
            names |= set(getattr(typing.get_args(hint)[0] if typing.get_args(hint) else hint,
                                 "__annotations__", {}))  # fmt: skip
        elif parameter.name not in ("self", "cls"):
            names.add(parameter.name)
    return names


def test_the_fake_sdk_keeps_step_with_the_real_one(fake_sdk) -> None:
    """The fake accepts exactly what E2BSandbox passes, and so does the installed SDK (only
    checked where e2b-code-interpreter is installed: `pip install 'mars2[e2b]'`)."""
    box = E2BSandbox(api_key="k", template="base", sdk=fake_sdk)
    try:
        used = set(box.create_options())
    finally:
        box.close()
    assert used == {"api_key", "timeout", "allow_internet_access", "template"}
    assert used <= _accepted(fake_sdk.AsyncSandbox.create)
    real = pytest.importorskip("e2b_code_interpreter")
    accepted = _accepted(real.AsyncSandbox.create)
    assert used <= accepted, used - accepted
    fake_only = _accepted(fake_sdk.AsyncSandbox.create) - accepted
    assert not fake_only, fake_only
    # What E2BSandbox calls on a sandbox: commands.run(cmd, timeout=...) and files.write(path, data).
    from e2b.sandbox_async.commands.command import Commands
    from e2b.sandbox_async.filesystem.filesystem import Filesystem

    assert {"cmd", "timeout"} <= _accepted(Commands.run)
    assert {"path", "data"} <= _accepted(Filesystem.write)
    assert _accepted(e2b_sdk.Commands.run) <= _accepted(Commands.run)
    assert _accepted(e2b_sdk.Files.write) <= _accepted(Filesystem.write)


def test_the_creation_rate_is_honoured_counting_refused_and_slow_requests(fake_sdk) -> None:
    # Every other create request is refused (429) or slow: the rate limit counts requests as they
    # are sent (what E2B counts), so no two arrive closer than 1/rate, refused ones included.
    faults = iter(["429", "slow", None, "429", None, "slow", None] + [None] * 20)
    fake_sdk.STATE.create_fault = lambda: next(faults)
    fake_sdk.STATE.slow_seconds = 0.3
    with E2BSandbox(
        api_key="k", max_concurrency=5, max_creates_per_second=10.0, create_jitter=0.0,
        backoff=0.01, seed=0, sdk=fake_sdk,
    ) as box:  # fmt: skip
        results = box.run_batch([Job(ADD, "stdin", TESTS)] * 5)
    assert all(r.all_passed for r in results)
    times = sorted(fake_sdk.STATE.request_times)
    assert len(times) == fake_sdk.STATE.created + 2 >= 5  # the 2 refused requests counted too
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.1 - 0.01, gaps  # the event loop may wake a timer a tick early

"""The container around the executor: read-only root, private /tmp and /dev/shm, IPC, hidden
directories, the seccomp filter, isolation levels, and a pool run by an ordinary user."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import mars2
from mars2.sandbox.base import Job, Verdict
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.runner.scratch import make_private_dir
from tests.sandbox_cases import ADD, ADD_CODE, FORGERIES, HOSTILE, UNIQUE, verdicts


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
from mars2.sandbox.base import Job
from mars2.sandbox.pool.local import LocalSandbox
code = sys.argv[1]
with LocalSandbox(num_workers=1, per_test_timeout=2.0) as box:
    (result,) = box.run_batch([Job(code, "stdin", [{"input": "", "output": "x"}])])
    print(result.tests[0].actual.strip())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a filesystem for the test needs root")
def test_other_filesystems_mounted_on_the_host_are_read_only_too() -> None:
    """A read-only bind of / alone does not reach filesystems mounted below it: bubblewrap's
    --ro-bind makes every one read-only."""
    extra = Path(make_private_dir("/var/tmp", "mars2-mount-"))
    try:
        # A world-writable filesystem of its own, as a separate /home or /var/tmp would be;
        # mounted in a mount namespace of the test's (util-linux's unshare), which the pool's
        # workers inherit and the host never sees.
        script = f'mount -t tmpfs -o size=1m,mode=1777 tmpfs {extra} && exec "$0" -c "$1" "$2"'
        shown = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
             sys.executable, OTHER_MOUNT, _try_writing_in(f"{str(extra)!r}, '/dev/shm', '.'")],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        lines = dict(line.rsplit(" ", 1) for line in shown.stdout.strip().splitlines())
        assert lines == {str(extra): "30", "/dev/shm": "written", ".": "written"}, lines
        assert not any(extra.iterdir())  # the mount was the test process's alone
    finally:
        extra.rmdir()


def test_isolation_report_is_honest(sandbox: LocalSandbox) -> None:
    report = sandbox.isolation
    assert report["level"] == "required" and report["missing"] == []
    assert report["container"] and report["seccomp"] and report["pid_namespace"]
    assert report["network_isolated"] and report["readonly_root"] and report["private_tmp"]
    assert report["user_namespace"] is (os.geteuid() != 0)
    assert (report["sandbox_uid"] is not None) is (os.geteuid() == 0)


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


HIDE_ALL_BUT = """
import json, os, sys
closed, keep, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgid(uid)
os.setuid(uid)
seen = {"listing": sorted(os.listdir(closed)), "module": open(keep + "/mod.py").read()}
try:
    seen["secret"] = open(closed + "/secret.txt").read()
except OSError as err:
    seen["secret"] = err.errno
print(json.dumps(seen))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another uid in the container needs root")
def test_interpreter_under_a_closed_directory_is_exposed_alone_and_nothing_is_staged() -> None:
    """A pyenv under /root, say: only its own directory becomes visible to a job's uid (and the
    directories on the way there traversable), and nothing is created on the host to expose it."""
    from mars2.sandbox.container import bubblewrap

    base = Path(make_private_dir("/var/tmp", "mars2-closed-"))
    try:
        base.chmod(0o755)
        closed = base / "closed"
        (closed / "deep" / "lib").mkdir(parents=True)
        closed.chmod(0o700)
        (closed / "secret.txt").write_text("secret")
        (closed / "deep" / "lib" / "mod.py").write_text("X = 1\n")
        (closed / "deep" / "lib").chmod(0o755)
        (closed / "deep" / "lib" / "mod.py").chmod(0o644)
        before = sorted(str(p) for p in base.rglob("*"))
        keep = [*bubblewrap.interpreter_paths(), str(closed / "deep" / "lib")]
        bwrap = bubblewrap.find_bwrap()
        assert bwrap is not None
        assert str(closed) in bubblewrap.hidden_directories(keep)
        argv = bubblewrap.container_argv(
            bwrap, allow_network=False, tmp_size_mb=8, as_root=True, keep=keep
        )
        shown = subprocess.run(
            [*argv, "--", sys.executable, "-c", HIDE_ALL_BUT, str(closed),
             str(closed / "deep" / "lib"), "61999"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        seen = json.loads(shown.stdout)
        assert seen["listing"] == ["deep"] and seen["module"] == "X = 1\n"
        assert seen["secret"] == 2  # ENOENT: gone, not merely unreadable
        assert sorted(str(p) for p in base.rglob("*")) == before
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_without_a_container_jobs_use_a_host_dir_the_pool_removes() -> None:
    """best_effort where bubblewrap cannot run: the jobs' directories live in a fresh directory
    under scratch_dir (nothing else there is touched), which the pool removes when it closes."""
    scratch = Path(make_private_dir("/var/tmp", "mars2-scratch-"))
    try:
        scratch.chmod(0o755)  # job uids pass through it to their own directories
        (scratch / "keep.txt").write_text("x")
        code = "import os\nopen('answer.txt', 'w').write('x')\nprint(os.getcwd())\n"
        with LocalSandbox(
            num_workers=1, isolation="best_effort", bwrap=str(scratch / "no-bwrap"),
            scratch_dir=str(scratch),
        ) as box:  # fmt: skip
            report = box.isolation
            assert not report["container"] and not report["readonly_root"]
            assert any("bubblewrap" in m for m in report["missing"])
            (result,) = box.run_batch([Job(code, "stdin", [{"input": "", "output": ""}])])
            workdir = Path(result.tests[0].actual.strip())
            assert workdir.parent.parent == scratch, result.tests[0]
            assert workdir.parent.name.startswith("mars2-sandbox-")
        assert sorted(p.name for p in scratch.iterdir()) == ["keep.txt"]
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(scratch)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="job uids exist only for a root pool")
def test_a_scratch_dir_job_uids_cannot_enter_is_refused_loudly(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(RuntimeError, match="cannot enter"):
        LocalSandbox(
            num_workers=1, isolation="best_effort", bwrap=str(tmp_path / "no-bwrap"),
            scratch_dir=str(closed),
        )  # fmt: skip


def test_jobs_cannot_make_namespaces(sandbox: LocalSandbox) -> None:
    assert sandbox.isolation["seccomp"]  # required: the pool would not have started without
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


# --- isolation levels and the seccomp filter -----------------------------------------------------


def test_required_refuses_in_one_paragraph_and_best_effort_warns(tmp_path: Path, caplog) -> None:
    from mars2.sandbox.container.policy import IsolationUnavailable, plan

    missing = str(tmp_path / "no-bwrap")
    with pytest.raises(IsolationUnavailable) as refused:
        LocalSandbox(num_workers=1, bwrap=missing)
    said = str(refused.value)
    assert "\n" not in said and missing in said
    for way in ("user namespaces", "sandbox.isolation=best_effort", "sandbox=e2b", "bubblewrap"):
        assert way in said, way
    with pytest.raises(ValueError, match="isolation"):
        plan("none")
    with (
        caplog.at_level("WARNING"),
        LocalSandbox(num_workers=1, isolation="best_effort", bwrap=missing) as box,
    ):
        assert verdicts(box, ADD_CODE) == [Verdict.PASSED, Verdict.PASSED]
    assert "best_effort" in caplog.text and missing in caplog.text


def test_the_seccomp_filter_covers_every_abi_of_this_machine() -> None:
    """libseccomp writes the filter: the refused calls on this architecture and on the others a
    job could enter the kernel through (32-bit x86 and x32 beside x86_64, arm beside aarch64)."""
    import platform

    from mars2.sandbox.container import seccomp

    text = seccomp.export_text()
    arches = {
        line.split("arch ")[1].split()[0] for line in text.splitlines() if "filter for arch" in line
    }
    compat = {"x86_64": {"x86_64", "x86", "x32"}, "aarch64": {"aarch64", "arm"}}
    assert compat.get(platform.machine(), set()) <= arches, arches
    for call in ("unshare", "setns", "mount", "bpf", "shmget", "mq_open", "fsopen", "clone3"):
        assert f'"{call}"' in text, call
    filters, uncovered = seccomp.build_filters()
    assert uncovered == [] and len(filters) >= 1


# --- a pool run by an ordinary user (uid 65534, Debian's python3, no third-party packages) -------

NONROOT_POOL = """
import json, logging, os, sys
if sys.argv[1] == "forbid":
    # As on a machine that forbids unprivileged user namespaces (Docker's default seccomp profile
    # does): this process and everything it starts may create no namespace at all.
    from mars2.sandbox.container import seccomp
    seccomp.install()
from mars2.sandbox.base import Job
from mars2.sandbox.container.policy import IsolationUnavailable
from mars2.sandbox.pool.local import LocalSandbox
cases = json.loads(sys.stdin.read())
out = {"uid": os.getuid()}
warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("mars2").addHandler(Catch())
options = dict(num_workers=1, per_test_timeout=2.0, job_timeout=20.0, scratch_dir=sys.argv[2])
try:
    box = LocalSandbox(**options)
except IsolationUnavailable as err:
    out["refused"] = str(err)
    box = LocalSandbox(isolation="best_effort", **options)
out["warnings"] = warnings
with box:
    out["isolation"] = box.isolation
    results = {}
    for name, (code, tests) in cases.items():
        (result,) = box.run_batch([Job(code, "stdin", tests)])
        results[name] = [[t.verdict.value, t.actual, t.error[-300:]] for t in result.tests]
    out["results"] = results
print(json.dumps(out))
"""

NONROOT_JOBS = {
    "network": (
        # The test listens on the host's loopback (the port follows); the container's loopback is
        # its own, and nothing else is reachable.
        "import socket, sys\nport = int(sys.stdin.read())\n"
        "for address in (('127.0.0.1', port), ('1.1.1.1', 53)):\n    try:\n"
        "        socket.create_connection(address, timeout=1)\n        print('connected')\n"
        "    except OSError as err:\n        print(err.errno)\n",
        [{"input": "PORT", "output": "111\n101"}],  # ECONNREFUSED, ENETUNREACH
    ),
    "private tmp, first job": (
        "open('/tmp/mars2-leftover', 'w').write('x')\nopen('/dev/shm/leftover', 'w').write('x')\n"
        "print('written')\n",
        [{"input": "", "output": "written"}],
    ),
    "private tmp, next job": (
        "import os\nprint(os.path.exists('/tmp/mars2-leftover'), os.listdir('/dev/shm'))\n",
        [{"input": "", "output": "False []"}],
    ),
    "the executor is out of reach": (
        "import os, signal\nfor call in (lambda: os.kill(1, signal.SIGKILL), "
        "lambda: open('/proc/1/mem', 'rb').read(1)):\n    try:\n        call()\n"
        "    except OSError as err:\n        print('refused', err.errno)\n"
        "fields = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "print(fields['NoNewPrivs'].strip(), fields['Seccomp'].strip())\n",
        [{"input": "", "output": "refused 13\n1 2"}],  # kill(1) is ignored (init); mem: EACCES
    ),
    "32 threads": (
        "import threading, time\n"
        "ts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(32)]\n"
        "for t in ts:\n    t.start()\nprint(threading.active_count() - 1)\n",
        [{"input": "", "output": "32"}],
    ),
    "fork bomb": (HOSTILE["fork bomb"][0], ADD[:1]),
    "after it": (ADD_CODE, ADD),
}


def _run_as_nobody(mode: str, jobs: dict, copy: Path, scratch: Path) -> dict:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(copy), "LANG": "C.UTF-8"}
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         "/usr/bin/python3", "-c", NONROOT_POOL, mode, str(scratch)],
        input=json.dumps(jobs), capture_output=True, text=True, env=env, cwd=copy, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture
def nobody_checkout() -> Iterator[tuple[Path, Path, Path]]:
    """The package copied where uid 65534 can read it, and two directories it can write."""
    import shutil

    if os.geteuid() != 0:
        pytest.skip("becoming uid 65534 needs root")
    if not (Path("/usr/bin/python3").exists() and shutil.which("setpriv")):
        pytest.skip("needs Debian's /usr/bin/python3 and setpriv")
    copy = Path(tempfile.mkdtemp(prefix="mars2-nonroot-"))
    writable = Path(tempfile.mkdtemp(prefix="mars2-nonroot-w-", dir="/var/tmp"))
    try:
        copy.chmod(0o755)
        shutil.copytree(
            Path(mars2.__file__).parent, copy / "mars2",
            ignore=shutil.ignore_patterns("__pycache__", "configs"),
        )  # fmt: skip
        subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
        scratch = writable / "scratch"
        scratch.mkdir()
        for path in (writable, scratch):
            os.chown(path, 65534, 65534)
        yield copy, writable, scratch
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        subprocess.run(["rm", "-rf", "--one-file-system", str(writable)], check=False)


def test_an_ordinary_user_gets_the_container_or_a_clear_refusal(nobody_checkout) -> None:
    """The hostile cases of the root tests, run by a pool of uid 65534 under a system
    interpreter: no network, a read-only root, private /tmp and /dev/shm emptied between jobs,
    an executor jobs cannot signal or read, forged verdicts that fail, nothing left behind. Where
    this machine forbids unprivileged user namespaces, `required` must refuse instead and
    `best_effort` warn and still grade."""
    import socket

    copy, writable, scratch = nobody_checkout
    listener = socket.create_server(("127.0.0.1", 0))
    jobs = dict(NONROOT_JOBS)
    code, tests = jobs["network"]
    jobs["network"] = (code, [{**tests[0], "input": str(listener.getsockname()[1])}])
    jobs["read-only root"] = (
        _try_writing_in(f"{str(writable)!r}, '/dev/shm', '.'"),
        [{"input": "", "output": ""}],
    )
    for name, code in FORGERIES.items():
        jobs[f"forgery: {name}"] = (code, UNIQUE)
    try:
        seen = _run_as_nobody("plain", jobs, copy, scratch)
    finally:
        listener.close()
    assert seen["uid"] == 65534
    report, results = seen["isolation"], seen["results"]
    if "refused" in seen:  # this machine forbids unprivileged user namespaces
        assert "user namespaces" in seen["refused"] and "best_effort" in seen["refused"]
        assert seen["warnings"] and not report["container"]
        assert results["after it"][0][0] == "passed"
        return
    assert report["container"] and report["user_namespace"] and report["seccomp"], report
    assert report["missing"] == [] and seen["warnings"] == []
    for name in ("network", "private tmp, first job", "private tmp, next job"):
        assert [r[0] for r in results[name]] == ["passed"], (name, results[name])
    assert results["the executor is out of reach"][0][0] == "passed", results
    # The task limit binds per user namespace: 32 threads run, a fork bomb stops at the limit.
    assert results["32 threads"][0][0] == "passed", results["32 threads"]
    assert results["fork bomb"][0][0] in ("runtime_error", "timeout"), results["fork bomb"]
    assert [r[0] for r in results["after it"]] == ["passed", "passed"]
    written = dict(
        line.rsplit(" ", 1) for line in results["read-only root"][0][1].split("\n") if line
    )
    assert written == {str(writable): "30", "/dev/shm": "written", ".": "written"}, written
    for name in FORGERIES:
        got = {r[0] for r in results[f"forgery: {name}"]}
        assert got <= {"wrong_answer", "runtime_error"}, (name, got)
    assert not Path("/tmp/mars2-leftover").exists()
    assert sorted(p.name for p in writable.iterdir()) == ["scratch"]
    assert list(scratch.iterdir()) == []


def test_where_user_namespaces_are_forbidden_required_refuses_and_best_effort_warns(
    nobody_checkout,
) -> None:
    copy, _, scratch = nobody_checkout
    seen = _run_as_nobody("forbid", {"after it": (ADD_CODE, ADD)}, copy, scratch)
    assert "cannot create its namespaces" in seen["refused"], seen
    for way in ("user namespaces", "sandbox.isolation=best_effort", "sandbox=e2b"):
        assert way in seen["refused"]
    assert any("best_effort" in w and "namespaces" in w for w in seen["warnings"]), seen
    assert not seen["isolation"]["container"] and seen["isolation"]["seccomp"]
    assert [r[0] for r in seen["results"]["after it"]] == ["passed", "passed"]
    assert list(scratch.iterdir()) == []  # the worker removed its jobs' directory


SYMLINKED_VENV = """
from mars2.sandbox.base import Job
from mars2.sandbox.pool.local import LocalSandbox
with LocalSandbox(num_workers=1, per_test_timeout=2.0) as box:
    (result,) = box.run_batch([Job("print(int(input()) + 1)", "stdin", [{"input": "1", "output": "2"}])])
    print(result.tests[0].verdict.name)
"""


def test_a_venv_reached_through_a_symlink_starts_the_container(tmp_path: Path) -> None:
    """`.venv -> <real venv>`: the container binds the venv's real path, so the interpreter it
    executes must be named by that path too (it used to run the unresolved `sys.executable`:
    `bwrap: execvp .venv/bin/python: No such file or directory`)."""
    link = tmp_path / ".venv"
    link.symlink_to(Path(sys.prefix).resolve())
    python = link / "bin" / Path(sys.executable).name
    src = str(Path(mars2.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([str(python), "-c", SYMLINKED_VENV], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "PASSED"

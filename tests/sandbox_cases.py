"""Cases the sandbox test files share: jobs, hostile answers, forgeries, and a helper to run one."""

from __future__ import annotations

from mars2.sandbox.base import Job, Sandbox, Verdict

ADD = [{"input": "1 2", "output": "3"}, {"input": "5 5", "output": "10"}]
ADD_CODE = "a, b = map(int, input().split())\nprint(a + b)\n"


def verdicts(
    sandbox: Sandbox, code: str, tests=ADD, kind: str = "stdin", fn_name=None
) -> list[Verdict]:
    (result,) = sandbox.run_batch([Job(code, kind, tests, fn_name=fn_name)])
    return [t.verdict for t in result.tests]


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


FAIL_THEN_LOOP = "def f(x):\n    if x == 1:\n        return 0\n    while True:\n        pass\n"
TWO_ASSERTS = {
    "input": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 3\n",
    "output": "",
}

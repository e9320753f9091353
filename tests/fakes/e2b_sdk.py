"""A local fake of the `e2b_code_interpreter` SDK surface E2BSandbox uses (no network).

The real service cannot be reached here. `AsyncSandbox` runs commands as local subprocesses, maps
remote paths into a temporary directory, raises on a non-zero exit like the SDK does, and can be
told to fail its first calls (to exercise retries) and to record its peak concurrency.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any


class CommandExitError(Exception):
    """Like the SDK's exception for a non-zero exit: it carries the command's output."""

    def __init__(self, stdout: str, stderr: str, exit_code: int) -> None:
        super().__init__(f"exit code {exit_code}")
        self.stdout, self.stderr, self.exit_code = stdout, stderr, exit_code


class Result:
    def __init__(self, stdout: str, stderr: str, exit_code: int) -> None:
        self.stdout, self.stderr, self.exit_code = stdout, stderr, exit_code


class FakeState:
    def __init__(self) -> None:
        self.created = 0
        self.creating = 0  # creates in flight now
        self.peak_creating = 0
        self.create_times: list[float] = []
        # When each create request arrived (before any injected fault or delay): what a
        # creation-rate limit counts, refused requests included.
        self.request_times: list[float] = []
        self.create_options: list[dict[str, Any]] = []
        self.killed = 0
        self.running = 0
        self.peak = 0
        self.fail_next_commands = 0
        # Fault injection (the chaos suite): called before each create / command, returns None
        # or one of "429", "5xx", "timeout", "slow" (a create that takes `slow_seconds`).
        self.create_fault: Any = None
        self.command_fault: Any = None
        self.slow_seconds = 0.3
        self.api_keys: list[str] = []
        self.written: dict[str, str] = {}  # remote path -> what was written there


STATE = FakeState()


class RateLimitException(Exception):
    """What the SDK raises on HTTP 429."""


class SandboxException(Exception):
    """What the SDK raises on other API errors (5xx here)."""


class TimeoutException(Exception):
    """What the SDK raises when a request times out."""


async def _inject(plan: Any) -> None:
    fault = plan() if plan is not None else None
    if fault == "429":
        raise RateLimitException("429: Rate limit exceeded (fake)")
    if fault == "5xx":
        raise SandboxException("503: Service Unavailable (fake)")
    if fault == "timeout":
        await asyncio.sleep(0.05)
        raise TimeoutException("request timed out (fake)")
    if fault == "slow":
        await asyncio.sleep(STATE.slow_seconds)


class Files:
    def __init__(self, box: AsyncSandbox) -> None:
        self.box = box

    async def write(self, path: str, data: str) -> None:  # the SDK's write(path, data, ...)
        STATE.written[path] = data
        local = self.box.local(path)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(data)


class Commands:
    def __init__(self, box: AsyncSandbox) -> None:
        self.box = box

    async def run(self, cmd: str, timeout: float | None = 60) -> Result:
        command = cmd
        await _inject(STATE.command_fault)
        if STATE.fail_next_commands > 0:
            STATE.fail_next_commands -= 1
            raise ConnectionError("fake transient network error")
        STATE.running += 1
        STATE.peak = max(STATE.peak, STATE.running)
        try:
            local_command = command.replace("/tmp/", f"{self.box.root}/tmp/").replace(
                "python3 ", f"{sys.executable} "
            )
            proc = await asyncio.create_subprocess_shell(
                local_command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        finally:
            STATE.running -= 1
        if proc.returncode:
            raise CommandExitError(out.decode(), err.decode(), proc.returncode)
        return Result(out.decode(), err.decode(), 0)


class AsyncSandbox:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fake-e2b-"))
        self.files = Files(self)
        self.commands = Commands(self)

    def local(self, remote: str) -> Path:
        return self.root / remote.lstrip("/")

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        timeout: int | None = None,
        allow_internet_access: bool | None = None,
        *,
        api_key: str,
    ) -> AsyncSandbox:
        """The real SDK's keywords that E2BSandbox uses (tests check them against the SDK)."""
        STATE.request_times.append(asyncio.get_running_loop().time())
        await _inject(STATE.create_fault)
        STATE.creating += 1
        STATE.peak_creating = max(STATE.peak_creating, STATE.creating)
        STATE.create_times.append(asyncio.get_running_loop().time())
        STATE.create_options.append(
            {
                "template": template,
                "timeout": timeout,
                "allow_internet_access": allow_internet_access,
            }
        )
        try:
            await asyncio.sleep(0.02)  # a create takes a while: concurrent ones overlap
        finally:
            STATE.creating -= 1
        STATE.created += 1
        STATE.api_keys.append(api_key)
        return cls()

    async def kill(self) -> None:
        STATE.killed += 1
        shutil.rmtree(self.root, ignore_errors=True)

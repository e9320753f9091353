"""One error style for every command: a check of ours ends the command with exit code 1 and one
paragraph on stderr, no traceback. ``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback.

A command that fails before it wrote anything leaves no run folder behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

DEBUG_FLAG = "--debug"


class CommandLineError(ValueError):
    """An override that cannot work (a typo, an unknown config name); names the fix."""


def take_debug_flag(argv: list[str]) -> None:
    """Remove ``--debug`` from `argv` (Hydra does not know it) and turn full tracebacks on."""
    if DEBUG_FLAG in argv:
        argv.remove(DEBUG_FLAG)
        os.environ["HYDRA_FULL_ERROR"] = "1"


def debugging() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors our checks raise: each message is the whole story, a traceback adds nothing."""
    from mars2.data.problem import ProblemFormatError
    from mars2.generation.reference import AnswerKeyError
    from mars2.models.loading import ModelLoadError
    from mars2.models.memory import MemoryBudgetError
    from mars2.utils.atomic import WriteError
    from mars2.utils.runs import RunFolderError
    from mars2.utils.validation import ConfigError

    return (
        CommandLineError,
        ConfigError,
        RunFolderError,
        ProblemFormatError,
        AnswerKeyError,
        ModelLoadError,
        MemoryBudgetError,
        WriteError,
    )


def fail(message: str) -> NoReturn:
    """Print `message` as the command's error and exit with status 1."""
    print(f"Error: {message.strip()}", file=sys.stderr, flush=True)
    raise SystemExit(1)


# What a command writes into its run folder before it has any result.
_BOOKKEEPING = {".hydra", "eval_record.json"}


def remove_if_unused(run_dir: str | Path | None) -> None:
    """Delete a run folder that holds nothing but bookkeeping (Hydra's config and log, an
    evaluation's record of its settings)."""
    if run_dir is None:
        return
    folder = Path(run_dir)
    if not folder.is_dir():
        return
    entries = list(folder.iterdir())
    if all(e.name in _BOOKKEEPING or (e.is_file() and e.suffix == ".log") for e in entries):
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def reported(run_dir: str | Path | None = None) -> Iterator[None]:
    """Our errors become one paragraph and exit status 1; any failure removes an unused run
    folder (other errors keep their traceback: they are bugs to report)."""
    try:
        yield
    except BaseException as error:
        remove_if_unused(run_dir)
        if isinstance(error, user_errors()) and not debugging():
            fail(str(error))
        raise

"""Console entry points (`mars2-train`, `mars2-eval`, `mars2-data`); Hydra reads configs from
`mars2.configs`.

The configs ship inside the package (``pkg://mars2.configs``, the repository's ``configs/``), so
the scripts work from any directory and from a wheel. Add your own config directories with
``hydra.searchpath=[file:///abs/dir]`` (or ``--config-dir DIR``): a file there such as
``experiment/mine.yaml`` is then selectable as ``experiment=mine``.

Every command checks its config before Hydra starts the job (`mars2.cli.preflight`) and reports
our own errors as one paragraph with exit status 1 (`mars2.cli.errors`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mars2.utils.runs import register_resolver

CONFIG_PATH = "pkg://mars2.configs"
register_resolver()  # ${mars2_run_dir:...} in configs/hydra/default.yaml, before Hydra reads it


def default_root() -> None:
    """Point ``paths.root_dir`` (logs/, .cache/) at the checkout when running from one.

    An editable install or ``python src/mars2/train.py`` writes into the checkout as before; an
    installed wheel writes below the working directory (``paths.root_dir`` defaults to ``.``).
    ``MARS2_ROOT`` set by the user always wins.
    """
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs").is_dir():
        os.environ.setdefault("MARS2_ROOT", str(checkout))


def run_command(task: str, hydra_main: Callable[[], Any]) -> None:
    """Run a Hydra command after its checks (see `mars2.cli.preflight`): a mistake ends it with
    one paragraph and exit status 1 before any folder is made (``--debug``: the traceback)."""
    from mars2.cli.errors import reported, take_debug_flag
    from mars2.cli.preflight import preflight
    from mars2.utils.logs import quiet_libraries

    default_root()
    quiet_libraries()  # the checks load tokenizers (prompt caps)
    take_debug_flag(sys.argv)
    with reported():
        preflight(task, sys.argv[1:])
    hydra_main()

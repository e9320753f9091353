"""Checks a command runs on its own composition of the config before Hydra starts the job.

Hydra creates the run folder before the job runs and reports its own errors with a traceback or
a config search path. Composing the same config first lets every mistake that needs no model
end the command in one paragraph, with no folder left behind: an unknown config name (the valid
ones listed), a misspelt setting (the nearest one named), a ``+key`` that adds a setting the
receiving class does not take, a checkpoint or run that does not exist, and every check of
`mars2.utils.validation`.

Which ``+key`` additions are accepted: under the structured groups below, a key the receiving
class takes (its `_target_`'s arguments, e.g. ``+trainer.gradient_clip_val=1.0`` or
``+data.eval.limit=50``) and any key inside free-form blocks (``agents.<name>.generation.vllm``,
``agents.<name>.model.extra``); outside them, anything (your own top-level keys).
"""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mars2.cli.errors import CommandLineError
from mars2.utils.runs import RunFolderError, check_eval_folder, eval_record
from mars2.utils.validation import SPLIT_SETTINGS

CONFIG_MODULE = "mars2.configs"
# Our groups whose settings are fixed by a class (or, without a `_target_`, by the yaml itself).
STRUCTURED = (
    "eval", "trainer", "search", "agents", "grader", "advantage", "sandbox", "generation", "data"
)  # fmt: skip
_SPECIAL = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
# Flags after which Hydra does something else than run the job (or takes the config elsewhere).
_SKIP = {"--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc",
         "--experimental-rerun", "--config-name", "-cn", "--config-path",
         "-cp", "--version"}  # fmt: skip
_MULTIRUN = {"--multirun", "-m"}
# A sweep's jobs checked before the first starts (each check is cheap: problem sets are cached).
MAX_SWEEP_CHECKS = 64
_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-dir", "-cd", "--info", "-i"}


def _split(argv: list[str]) -> tuple[list[str], dict[str, str | None]]:
    overrides: list[str] = []
    flags: dict[str, str | None] = {}
    args = iter(argv)
    for arg in args:
        if arg.startswith("-") and "=" not in arg:
            flags[arg] = next(args, None) if arg in _WITH_VALUE else None
        else:
            overrides.append(arg)
    return overrides, flags


def preflight(task: str, argv: list[str]) -> None:
    """Compose `task`'s config from `argv` as Hydra will and run the checks (module docstring);
    raises `CommandLineError`, `RunFolderError` or the validation's `ConfigError`."""
    overrides, flags = _split(argv)
    if _SKIP & flags.keys():
        return
    config_dir = flags.get("--config-dir") or flags.get("-cd")
    if config_dir:
        if any(o.startswith("hydra.searchpath") for o in overrides):
            return  # both ways of adding a config dir at once: leave it to Hydra
        overrides = [*overrides, f"hydra.searchpath=[file://{config_dir}]"]
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        if _MULTIRUN & flags.keys():
            for job in sweep_jobs(overrides):  # every job of the sweep, before the first starts
                _check_job(task, job, flags, multirun=True)
        else:
            _check_job(task, overrides, flags, multirun=False)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override lists of a ``-m`` sweep's jobs (Hydra's basic sweeper's expansion), at most
    `MAX_SWEEP_CHECKS` of them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as error:
        first = str(error).strip().splitlines()[0]
        raise CommandLineError(f"cannot read the override: {first}.") from error
    sweeper = [o for o in parsed if o.key_or_group.startswith("hydra.sweeper")]
    if sweeper:  # another sweeper (optuna, ...) picks the values: check the base config only
        return [[o.input_line for o in parsed if not o.is_sweep_override() and o.input_line]]
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    return jobs[:MAX_SWEEP_CHECKS]


def _check_job(
    task: str, overrides: list[str], flags: dict[str, str | None], multirun: bool
) -> None:
    cfg = _compose(task, overrides)
    check_additions(task, overrides)
    shown = flags.get("--cfg") or flags.get("-c")
    if shown is not None or "--cfg" in flags or "-c" in flags:
        if shown == "hydra" and "--resolve" in flags and not multirun:
            # Hydra resolves its own block detached from the job's config, where
            # hydra.run.dir's ${task_name} and ${paths.log_dir} do not exist: print it here.
            print(OmegaConf.to_yaml(_resolved(cfg.hydra)), end="")
            raise SystemExit(0)
        return  # prints the config only: no folder, no run
    folder = "" if multirun else run_dir(cfg)  # a sweep's jobs write under hydra.sweep.dir
    if task == "train":
        from mars2.training.run import check_train

        check_train(cfg)
        return
    from mars2.eval.run import check_eval, check_trained

    check_eval(cfg)
    check_trained(cfg)  # the command line refuses untrained agents (eval.allow_untrained=true)
    if folder and Path(folder).is_dir():  # hydra.run.dir=<an earlier evaluation>: same settings
        check_eval_folder(folder, eval_record(cfg), "hydra.run.dir")


def _resolved(node: DictConfig) -> DictConfig:
    """`node` with each value resolved where it can be (Hydra's runtime values, set only once a
    job starts, are left as they are)."""
    out: dict[str, Any] = {}
    for key in node:
        try:
            value = node[key]
        except OmegaConfBaseException:
            out[str(key)] = node._get_node(key)._value()  # type: ignore[union-attr]
            continue
        out[str(key)] = (
            _resolved(value)
            if isinstance(value, DictConfig)
            else (
                OmegaConf.to_container(value, resolve=False)
                if OmegaConf.is_config(value)
                else value
            )
        )
    return OmegaConf.create(out)


def _compose(task: str, overrides: list[str]) -> DictConfig:
    try:
        return compose(config_name=task, overrides=overrides, return_hydra_config=True)
    except OverrideParseException as error:
        first = str(error).strip().splitlines()[0]
        bare = [o for o in overrides if re.fullmatch(r"[A-Za-z_][\w-]*", o)]
        if bare:
            raise CommandLineError(_bare_word(bare[0])) from error
        raise CommandLineError(
            f"cannot read the override: {first} (override syntax: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/)."
        ) from error
    except MissingConfigException as error:
        raise CommandLineError(_unknown_option(str(error))) from error
    except (HydraException, OmegaConfBaseException) as error:
        raise CommandLineError(_composition_error(task, overrides, str(error))) from error
    except ValueError as error:  # e.g. a config group set to null
        hint = ""
        if "Got NoneType" in str(error):
            hint = "; a config group cannot be null: drop it with ~<group>, e.g. ~logger"
        raise CommandLineError(f"{str(error).strip()}{hint}.") from error


def _bare_word(word: str) -> str:
    """`mars2-train tiny_pair`: a word without `key=`; name the group it belongs to."""
    loader = GlobalHydra.instance().config_loader()
    groups = [g for g in ("experiment", "data", "agent", "trainer", "search", "sandbox", "logger",
                          "debug") if word in loader.get_group_options(g)]  # fmt: skip
    if groups:
        return (
            f"{word}: every setting is key=value; did you mean {groups[0]}={word}? "
            f"(e.g. mars2-train {groups[0]}={word})"
        )
    options = loader.get_group_options("experiment")
    near = difflib.get_close_matches(word, options, n=1)
    hint = (
        f"; did you mean experiment={near[0]}?"
        if near
        else f" (experiments: {', '.join(options)})."
    )
    return f"{word}: every setting is key=value, e.g. experiment=tiny_pair{hint}"


def _unknown_option(message: str) -> str:
    found = re.search(r"Could not (?:load|find) '([^']+)/([^'/]+)'", message)
    if not found:
        return message.strip().splitlines()[0]
    group, name = found.groups()
    options = GlobalHydra.instance().config_loader().get_group_options(group)
    near = difflib.get_close_matches(name, options, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return (
        f"{group}={name}: there is no {group} config named {name!r}{hint}. The {group} configs "
        f"are: {', '.join(options)}. Your own go in a folder added with hydra.searchpath=[file:///"
        f"abs/dir] (as {group}/<name>.yaml)."
    )


def _composition_error(task: str, overrides: list[str], message: str) -> str:
    found = re.search(r"Could not override '([^']+)'", message)
    first = " ".join(line.strip() for line in message.strip().splitlines()[:2])
    if not found:
        return first
    key = found.group(1)
    rest = [o for o in overrides if _override_key(o) != key]
    try:
        base = compose(config_name=task, overrides=rest, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException):
        return first
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(base, parent) if parent else base
    if not isinstance(node, DictConfig):
        missing = _missing_block(base, key)
        if missing is not None:
            return missing
        return f"{key}: {parent or 'the config'} is not a block of settings, so it has no {name!r}."
    keys, free = _valid_keys(node, top=parent in STRUCTURED or not parent, path=parent)
    where = parent or "the config"
    near = difflib.get_close_matches(name, sorted(keys), n=1)
    if near and near[0] != name:
        return (
            f"{key}: {where} has no setting {name!r}; did you mean {_join(parent, near[0])}? "
            f"Its settings: {_listed({k for k in keys if k in node})}."
        )
    if free or name in keys:
        return f"{key}: {where} has no {name!r} yet; add it with +{key}=... ({where} takes it)."
    return f"{key}: {where} has no setting {name!r}; its settings: {_listed(keys)}."


def _missing_block(base: DictConfig, key: str) -> str | None:
    """The message for a key whose path names a block that does not exist (an unknown agent, a
    per-agent setting written at the top level), or None when every block on the path exists."""
    parts = key.split(".")
    node: Any = base
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part) if isinstance(node, DictConfig) else None
        if isinstance(child, DictConfig):
            node = child
            continue
        if child is not None or not isinstance(node, DictConfig):
            return None  # a value, not a missing block
        where = ".".join(parts[:depth])
        if where == "agents":
            names = sorted(str(k) for k in node)
            near = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean agents.{near[0]}?" if near else "."
            return (
                f"{key}: there is no agent {part!r} in this experiment{hint} Its agents: "
                f"{', '.join(names)}. Agents come from the experiment (experiment=...) or the "
                "agent list (agent=[a,b]); each selected file becomes agents.<name>."
            )
        agents = base.get("agents")
        rest = ".".join(parts[depth:])
        if not where and isinstance(agents, DictConfig) and any(
            OmegaConf.select(a, rest, default=None) is not None or part in a
            for a in agents.values()
        ):  # fmt: skip
            agent_names = [str(n) for n in agents]
            listed = ", ".join(f"agents.{n}.{rest}" for n in agent_names)
            return (
                f"{key}: {part} is a per-agent setting: set it for each agent ({listed}), e.g. "
                f"agents.{agent_names[0]}.{rest}=<value>."
            )
        keys = sorted(str(k) for k in node)
        near = difflib.get_close_matches(part, keys, n=1)
        hint = f"; did you mean {_join(where, near[0])}?" if near else "."
        return f"{key}: {where or 'the config'} has no block {part!r}{hint}"
    return None


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _listed(keys: set[str], most: int = 12) -> str:
    names = sorted(keys)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def _valid_keys(node: DictConfig, top: bool, path: str = "") -> tuple[set[str], bool]:
    """The keys `node` (at `path`) may hold, and whether it is free-form (takes any key)."""
    keys = {str(k) for k in node} - _SPECIAL
    if re.fullmatch(r"data\.[^.]+", path):  # a data split: mars2's own settings, and the loader's
        keys |= set(SPLIT_SETTINGS)
    target = node.get("_target_")
    if target is None:
        return keys, not top  # top-level blocks are fixed by their yaml; nested plain ones free
    try:
        made = hydra.utils.get_object(str(target))
        params = inspect.signature(made).parameters.values()
    except (ImportError, ValueError, TypeError, HydraException):
        return keys, True  # cannot tell: do not block the user
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return keys, True
    return keys | {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}, False


def check_additions(task: str, overrides: list[str]) -> None:
    """Refuse a ``+key`` (or ``++key``) that adds to a structured group a setting its class does
    not take, naming the nearest valid one."""
    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create().parse_overrides(overrides)
    adds = [
        o for o in parsed
        if (o.is_add() or o.is_force_add()) and not loader.get_group_options(o.key_or_group)
        and o.key_or_group.split(".")[0] in STRUCTURED
    ]  # fmt: skip
    if not adds:
        return
    kept = [o.input_line for o in parsed if o not in adds and o.input_line]
    base = compose(config_name=task, overrides=kept, return_hydra_config=True)
    for add in adds:
        parts = add.key_or_group.split(".")
        node: Any = base
        depth = 0
        while depth < len(parts) - 1 and isinstance(node.get(parts[depth]), DictConfig):
            node = node.get(parts[depth])
            depth += 1
        if not isinstance(node, DictConfig) or parts[depth] in node:
            continue  # a new block under an unset (null) setting, or an override of a known one
        keys, free = _valid_keys(node, top=depth == 0, path=".".join(parts[:depth]))
        if free or parts[depth] in keys:
            continue
        parent, name = ".".join(parts[:depth]), parts[depth]
        near = difflib.get_close_matches(name, sorted(keys), n=1)
        hint = f"; did you mean {_join(parent, near[0])}?" if near else "."
        raise CommandLineError(
            f"+{add.key_or_group}: {parent or 'the config'} has no setting {name!r}{hint} "
            f"Its settings: {_listed(keys)}. A + adds a key the config does not have; "
            "set an existing one without it (see docs/running.md, 'Overrides')."
        )


def run_dir(cfg: DictConfig) -> str:
    """The run folder Hydra will use; a checkpoint or run that does not exist is refused here."""
    try:
        return str(OmegaConf.select(cfg, "hydra.run.dir"))
    except OmegaConfBaseException as error:
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, RunFolderError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        message = str(error).splitlines()[0]
        if message.startswith(f"{RunFolderError.__name__} raised while resolving"):
            raise RunFolderError(message.split(": ", 1)[1]) from None
        raise CommandLineError(f"hydra.run.dir: {message}") from error

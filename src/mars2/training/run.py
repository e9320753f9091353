"""Build everything a training run needs from a composed Hydra config and run it."""

from __future__ import annotations

import itertools
import logging
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from mars2.builders import (
    build_agents,
    build_callbacks,
    build_grader,
    build_logger,
    build_problems,
    build_sandbox,
    flat_params,
)
from mars2.training.datamodule import TreeSearchDataModule
from mars2.training.members import is_trainable
from mars2.training.memory import apply_allocator_conf, check_memory, trainer_arguments
from mars2.training.progress import warm_start_bar
from mars2.training.rollout import RolloutEngine
from mars2.training.team_module import MultiAgentModule
from mars2.training.warm_start import WarmStartConfig, warm_start
from mars2.utils.environment import check_environment
from mars2.utils.logs import one_line_per_message, quiet_libraries
from mars2.utils.runs import (
    CHECKPOINT_DIR,
    RunFolderError,
    latest_checkpoint,
    resolve_checkpoint,
    resumable_run,
    truthy,
)
from mars2.utils.tracking import closed_on_failure, set_run_tag, tracker_lines
from mars2.utils.validation import ConfigError, validate_train_config

log = logging.getLogger(__name__)

# Known and intended: batches are pulled with `dataloader_iter` (no prefetch, so rollouts are
# on-policy) and checkpoints hold the post-step state of manually optimised agents.
for _pattern in (
    ".*dataloader_iter.*",
    ".*pre-optimization state.*",
    ".*isinstance\\(treespec, LeafSpec\\).*",
):
    warnings.filterwarnings("ignore", message=_pattern)


def run_warm_start(cfg: DictConfig, agents: dict[str, Any], logger: Any = None) -> None:
    """Supervised warm start of every trained agent on ``data.warm_start`` problems (disjoint
    from RL); each epoch's loss goes to the run's logger as ``warm_start/<agent>/loss`` (step =
    the epoch's number, from 1)."""
    if not cfg.data.get("warm_start"):
        raise ValueError(
            "warm_start is set but the data config has no warm_start problems (try data=arith)"
        )
    problems = build_problems(cfg, "warm_start")
    settings = WarmStartConfig(**OmegaConf.to_container(cfg.warm_start, resolve=True))  # type: ignore[arg-type]
    for name, agent in agents.items():
        if not is_trainable(agent):
            continue  # a frozen teammate keeps its weights
        with warm_start_bar(name, settings.epochs) as show:
            losses = warm_start(agent, problems, settings, on_epoch=_epochs(name, show, logger))
        log.info(
            "warm start of %s on %d problems: loss %.3f -> %.3f",
            name,
            len(problems),
            losses[0],
            losses[-1],
        )


def _epochs(name: str, show: Callable[[float], None], logger: Any) -> Callable[[float], None]:
    """Per-epoch warm-start callback: the progress bar, and the loss to the logger (at the epoch's
    number, 1 for the first, as the progress line shows it)."""
    count = itertools.count(1)

    def on_epoch(loss: float) -> None:
        show(loss)
        step = next(count)
        if logger:
            logger.log_metrics({f"warm_start/{name}/loss": loss}, step=step)

    return on_epoch


def warm_start_needed(cfg: DictConfig) -> bool:
    """Whether the run warms its agents up first: a fresh run with ``warm_start`` set, or a resumed
    one whose KL reference (full fine-tuning with β > 0, never checkpointed) is the warm-started
    policy; the seeded warm start rebuilds it and the checkpoint then brings the trained policy."""
    if not cfg.get("warm_start"):
        return False
    if not cfg.get("ckpt_path"):
        return True
    return any(
        float(agent.loss.get("beta", 0.0)) > 0 and agent.model.get("lora") is None
        for agent in cfg.agents.values()
        if agent.get("trainable", True)
    )


def build_rollout(cfg: DictConfig, grader: Any) -> RolloutEngine:
    """The rollout engine of ``cfg.rollout``: its schedule over ``data.train``, the search, the
    grader and the advantage settings."""
    # Built objects go in as call arguments of the partials, never through Hydra's merge (which
    # would turn dataclasses such as Problem into configs).
    spec: Any = OmegaConf.to_container(cfg.rollout, resolve=True)
    make_schedule = hydra.utils.instantiate(spec.pop("schedule"), _partial_=True)
    search = hydra.utils.instantiate(cfg.search, _convert_="all")
    make_engine = hydra.utils.instantiate(spec, _partial_=True)
    engine: RolloutEngine = make_engine(
        schedule=make_schedule(problems=build_problems(cfg, "train")),
        search=search,
        grader=grader,
        advantages=hydra.utils.instantiate(cfg.advantage),
        agent_statistics=search.agent_statistics,
    )
    return engine


def build_run(cfg: DictConfig) -> tuple[Any, TreeSearchDataModule, pl.Trainer, Any]:
    """(team module, datamodule, trainer, sandbox) for a training config."""
    pl.seed_everything(cfg.seed, workers=True)
    apply_allocator_conf(cfg)  # before any model reaches a GPU (idempotent)
    sandbox = build_sandbox(cfg)  # first: a sandbox that cannot start fails before any model loads
    try:
        check_sandbox(sandbox)
        return _build_run(cfg, sandbox)
    except BaseException:
        sandbox.close()
        raise


def check_sandbox(sandbox: Any) -> None:
    """Run one job through the real sandbox (its container included): a sandbox that cannot run
    code stops the run here, in one paragraph, rather than after the warm start."""
    from mars2.sandbox.base import Job

    try:
        (result,) = sandbox.run_batch([Job(_PROBE_CODE, "stdin", [{"input": "1", "output": "2"}])])
    except Exception as error:
        raise ConfigError(
            f"the sandbox ({type(sandbox).__name__}) could not run one test job: {error}. Check "
            "`sandbox.*` (see docs/sandbox.md); sandbox.isolation=best_effort runs without the "
            "parts of the container this machine lacks."
        ) from error
    if not result.all_passed:
        said = "; ".join(f"{t.verdict.name}: {t.stderr[-200:]}".strip() for t in result.tests)
        raise ConfigError(
            f"the sandbox ({type(sandbox).__name__}) ran a test job that must pass, and it did "
            f"not ({said or 'no verdict'}). Check `sandbox.*` (see docs/sandbox.md)."
        )


_PROBE_CODE = "print(int(input()) + 1)"


def _build_run(cfg: DictConfig, sandbox: Any) -> tuple[Any, TreeSearchDataModule, pl.Trainer, Any]:
    agents = build_agents(cfg)
    logger = build_logger(cfg)  # after the models load: a bad model path leaves no MLflow run
    if logger:
        logger.log_hyperparams(flat_params(cfg))  # first: a run that fails below has its params
    with closed_on_failure(logger):  # FAILED on an exception, KILLED on SIGTERM / Ctrl-C
        if warm_start_needed(cfg):
            run_warm_start(cfg, agents, logger)
        module: Any = MultiAgentModule(agents)
        datamodule = TreeSearchDataModule(build_rollout(cfg, build_grader(cfg, sandbox)), cfg.steps,
                                          int(cfg.get("max_staleness") or 0))  # fmt: skip
        trainer = hydra.utils.instantiate(
            trainer_arguments(cfg.trainer), callbacks=build_callbacks(cfg), logger=logger,
            _convert_="all",
        )  # fmt: skip
    return module, datamodule, trainer, sandbox


def check_train(cfg: DictConfig) -> None:
    """Everything a training run checks before it loads a model (the command line runs this
    before it creates the run folder)."""
    apply_allocator_conf(cfg)  # PYTORCH_CUDA_ALLOC_CONF before CUDA starts (the check may start it)
    # The plan's own arithmetic first (a run that cannot fit anywhere), then this machine.
    check_memory(cfg)  # refuses a GPU run that cannot fit, before anything is loaded
    check_environment(cfg, "train")  # the accelerator, backends, data files, ckpt_path
    validate_train_config(cfg)
    # Every row's root prompt against each agent's prompt cap (tokenizers only; data.*.too_long).
    build_problems(cfg, "train")
    if cfg.get("warm_start"):
        build_problems(cfg, "warm_start")


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the team; returns the last logged metrics."""
    one_line_per_message()
    quiet_libraries()
    out = Path(str(cfg.paths.output_dir))
    print(f"Run folder: {out}", flush=True)
    if cfg.get("print_config"):
        log.info("the resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True).rstrip())
    check_train(cfg)
    cfg.ckpt_path = resolve_checkpoint(cfg)  # resume=true: the run folder's newest checkpoint
    if truthy(cfg.get("resume")) and not cfg.ckpt_path:  # its checkpoints went since the check
        raise RunFolderError(
            f"resume: {out} has no checkpoint; nothing to resume. Start a fresh run without resume."
        )
    if str(cfg.get("resume")).strip().lower() == "true":
        _, skipped = resumable_run(out.parent)
        if skipped:
            log.info(
                "resume=true: skipped %s (no checkpoint: stopped or failed before their first "
                "one); continuing %s", ", ".join(f.name for f in skipped), out.name,
            )  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except SystemExit as stop:  # Ctrl-C and SIGTERM end here, after the callbacks saved the step
        set_run_tag(trainer.logger, "mars2.stopped_at_step", str(trainer.global_step))
        print(f"Stopped at step {trainer.global_step}. {written(out, trainer)}", flush=True)
        print("Continue this run with resume=true (the newest run of the experiment).", flush=True)
        if stop.code in (
            None,
            0,
        ):  # Lightning's SIGTERMException exits 0: a stopped run is not done
            raise SystemExit(128 + signal.SIGTERM) from stop
        raise
    finally:
        sandbox.close()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if cfg.get("ckpt_path") and datamodule.last is None:  # resumed a run that had finished
        log.info(
            "nothing to train: %s already holds step %d of trainer.max_steps=%s; raise steps "
            "(or trainer.max_steps) to continue it",
            cfg.ckpt_path, trainer.global_step, trainer.max_steps,
        )  # fmt: skip
    log.info("%s", summary_table(trainer.global_step, metrics))
    print(written(out, trainer), flush=True)
    command = eval_command(cfg, out)
    if command:
        print(f"Evaluate it:\n  {command}", flush=True)
    return metrics


# The last step's numbers a finished run shows (all of them are in MLflow and the callback metrics).
_SUMMARY = ("reward", "solve_rate", "nodes", "generator_busy", "sandbox_busy", "rollout_seconds")


def summary_table(step: int, metrics: dict[str, float]) -> str:
    """A short table of the last step: the team's numbers, then each agent's loss."""
    rows = [(k, metrics[k]) for k in _SUMMARY if k in metrics]
    rows += sorted((k, v) for k, v in metrics.items() if k.endswith("/loss") and k.count("/") == 1)
    width = max((len(k) for k, _ in rows), default=0)
    lines = [f"finished at step {step}; the last step:"]
    lines += [f"  {k:<{width}}  {v:.4f}" for k, v in rows]
    return "\n".join(lines)


# Overrides an evaluation must repeat to build the same agents as the training run.
_AGENT_OVERRIDES = ("experiment=", "agent=", "agents.", "+agents.", "paths.")


def eval_command(cfg: DictConfig, out: Path) -> str | None:
    """The `mars2-eval` command for this run's newest checkpoint, with the overrides that chose
    its agents (None without a checkpoint)."""
    last = latest_checkpoint(out)
    if last is None:
        return None
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            overrides = [
                o for o in HydraConfig.get().overrides.task if o.startswith(_AGENT_OVERRIDES)
            ]
    except (ImportError, ValueError):
        pass
    if not any(o.startswith("experiment=") for o in overrides):
        overrides.insert(0, f"experiment={cfg.get('experiment_name')}")
    return " ".join(["mars2-eval", *overrides, f"ckpt_path={last}"])


def written(out: Path, trainer: Any = None) -> str:
    """What a training run left in its folder, one path per line."""
    lines = []
    last = latest_checkpoint(out)
    if last is not None:
        step = f" (step {trainer.global_step})" if trainer is not None else ""
        lines.append(f"  checkpoint   {last}{step}")
    entries = (
        ("agents", "agents", "Hugging Face folders of the trained agents"),
        ("trees", "trees", "the search trees of every step"),
        ("overview", "overview.png", "expansion share and reward per agent over the steps"),
        ("tree pages", "tree_pages", "HTML pages of the last step's trees"),
    )
    for label, name, what in entries:
        if (out / name).exists():
            lines.append(f"  {label:<12} {out / name}  ({what})")
    lines += tracker_lines(getattr(trainer, "logger", None))
    if not (out / CHECKPOINT_DIR).exists():
        lines.append("  (no checkpoint yet)")
    return "Wrote:\n" + "\n".join(lines)

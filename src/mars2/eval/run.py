"""`mars2-eval ...`: every agent alone and the team, Pass@k and tree-search metrics."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from mars2 import builders
from mars2.eval.report import log_to_mlflow, table, write_reports
from mars2.eval.runner import Summary, evaluate_settings
from mars2.eval.settings import EvalSettings
from mars2.eval.tree_view import write_tree_pages
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.generation.reference import AnswerKey, AnswerKeyError, ModelFreeSource
from mars2.search.prompts import PromptBuilder
from mars2.search.runner import SearchConfig
from mars2.search.tree import load_trees
from mars2.training.members import team_members
from mars2.training.team_module import MultiAgentModule
from mars2.utils.environment import check_environment
from mars2.utils.logs import one_line_per_message, quiet_libraries
from mars2.utils.runs import check_eval_folder, eval_record, matching_eval_run, write_record
from mars2.utils.tracking import set_run_tag, tracked, tracker_lines
from mars2.utils.validation import ConfigError, validate_eval_config

log = logging.getLogger(__name__)


def load_team(cfg: DictConfig) -> MultiAgentModule:
    """The configured agents, with trained weights from `ckpt_path` when given."""
    team = MultiAgentModule(builders.build_agents(cfg))
    if cfg.get("ckpt_path"):
        state = torch.load(cfg.ckpt_path, map_location="cpu", weights_only=False)["state_dict"]
        missing, unexpected = team.load_state_dict(state, strict=False)
        if unexpected or any(k.startswith("agents.") for k in missing):
            raise ValueError(f"checkpoint {cfg.ckpt_path} does not match the configured agents: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")  # fmt: skip
        log.info("loaded trained agents from %s", cfg.ckpt_path)
    team.eval()
    return team


def eval_generators(
    team: MultiAgentModule, temperature: float, pool: EnginePool | None = None
) -> dict[str, Any]:
    """Every agent's generator at the eval temperature, serving the team's current weights."""
    return dict(build_generators(team_members(team), pool, temperature))


def uses_reference(cfg: DictConfig) -> bool:
    """`generation.backend=reference`: answers are the problems' reference solutions."""
    return (cfg.get("generation") or {}).get("backend") == "reference"


def answer_key(problems: list[Any], prompts: PromptBuilder | None = None) -> AnswerKey:
    """The reference backend's key: each problem's reference solution and fresh prompt."""
    prompts = prompts or PromptBuilder()
    texts = {p.id: prompts.fresh_messages(p)[-1]["content"] for p in problems}
    return AnswerKey.of(problems, texts)


def reference_generators(cfg: DictConfig, problems: list[Any]) -> dict[str, Any]:
    """`generation.backend=reference`: every agent answers with the reference solutions, and no
    model is loaded (the agents keep their names, so the report has its usual rows)."""
    key = answer_key(problems)
    sources = {}
    for name, agent in cfg.agents.items():
        settings: GenerationConfig = hydra.utils.instantiate(agent.generation, backend="reference")
        sources[name] = ModelFreeSource(str(name), settings)
    return dict(build_generators(sources, answer_key=key))


def run_evaluation(
    problems: list[Any],
    generators: dict[str, Any],
    grader: Any,
    search_config: SearchConfig,
    samples: int,
    out: Path,
    seed: int,
    chunk: int | None = 32,
) -> list[Summary]:
    """Every agent alone (Pass@k, single-agent tree) and the whole team (shared tree)."""
    return evaluate_settings(problems, generators, grader, search_config, samples, out, seed, chunk)


def check_eval(cfg: DictConfig) -> list[Any]:
    """Everything an evaluation checks before it loads a model (the command line runs this
    before it creates the run folder); returns the problems it will evaluate."""
    resolved = check_environment(cfg, "eval")  # backends, the data file, ckpt_path
    if resolved is not None:  # ckpt_path=<run folder>: its newest checkpoint
        log.info("ckpt_path=%s: evaluating its checkpoint %s", cfg.ckpt_path, resolved)
        cfg.ckpt_path = resolved
    validate_eval_config(cfg)
    # Each row's root prompt against each agent's prompt cap (data.eval.too_long).
    problems = builders.build_problems(cfg, "eval", cfg.eval.get("limit"))
    if uses_reference(cfg):
        try:
            answer_key(problems)
        except AnswerKeyError as error:
            raise ConfigError(f"generation.backend=reference: {error}") from error
    return problems


def untrained(cfg: DictConfig) -> list[str]:
    """The agents an evaluation would score with their initial weights: all of them without
    `ckpt_path` (reference answers aside), except those loaded from a training run's agents/
    export (``agents.<name>.model.path=<run>/agents/<name>``) and frozen teammates
    (``trainable: false``: their initial weights are the point)."""
    if cfg.get("ckpt_path") or uses_reference(cfg):
        return []
    return [
        str(name)
        for name, agent in (cfg.get("agents") or {}).items()
        if Path(str((agent.get("model") or {}).get("path", ""))).parent.name != "agents"
        and agent.get("trainable", True)
    ]


def check_trained(cfg: DictConfig) -> None:
    """Refuse to score untrained agents unless `eval.allow_untrained=true` (a baseline): a
    forgotten ckpt_path would otherwise report the initial weights as the run's results."""
    names = untrained(cfg)
    if not names or bool((cfg.get("eval") or {}).get("allow_untrained", False)):
        return
    raise ConfigError(
        f"no ckpt_path: this would evaluate {', '.join(names)} with their initial weights, not a "
        "training run's. Pass ckpt_path=<run folder> (its newest checkpoint) or "
        "ckpt_path=<run folder>/checkpoints/last.ckpt; for an untrained baseline on purpose, "
        "add eval.allow_untrained=true."
    )


def evaluate(cfg: DictConfig) -> list[Summary]:
    """Validate, build, run, report. Rerunning into the same output dir (`resume=true` or the
    same `hydra.run.dir`) keeps what is finished and redoes the rest exactly; a folder whose
    rows were made with other settings is refused (see mars2.utils.runs)."""
    one_line_per_message()
    quiet_libraries()
    out = Path(cfg.paths.output_dir)
    print(f"Run folder: {out}", flush=True)
    problems = check_eval(cfg)
    record = eval_record(cfg)
    check_eval_folder(out, record, "hydra.run.dir")
    if cfg.get("resume") is True or str(cfg.get("resume")).lower() == "true":
        found, why = matching_eval_run(out.parent, record)
        log.info("%s", why if found is None else f"resume=true: continuing {out} (same settings)")
    write_record(out, record)
    settings: EvalSettings = hydra.utils.instantiate(cfg.eval)
    if not cfg.get("ckpt_path") and not uses_reference(cfg):
        log.warning(
            "no ckpt_path: evaluating the agents' initial weights (UNTRAINED for the tiny agents);"
            " pass ckpt_path=<run folder>/checkpoints/last.ckpt (or the run folder) to evaluate "
            "a training run"
        )
    pool = EnginePool()  # the vLLM engines of this evaluation, closed at the end
    try:
        generators = _generators(cfg, problems, settings, pool)  # models load before MLflow starts
        logger = builders.build_logger(cfg)
        if logger:
            logger.log_hyperparams(builders.flat_params(cfg))
            tag_eval_run(logger, cfg)
        with tracked(logger):
            summaries = _evaluate(cfg, problems, out, settings, generators)
            print(table(summaries, caption(cfg, settings, len(problems))), flush=True)
            files = write_reports(summaries, out, run_metadata(cfg, settings, len(problems)))
            team_trees = sorted((out / "trees" / "team").glob("*.jsonl"), key=_natural) or sorted(
                (out / "trees").glob("*/*.jsonl"), key=_natural
            )
            chosen = (
                team_trees if settings.tree_pages is None else team_trees[: settings.tree_pages]
            )
            trees = [t for path in chosen for t in load_trees(path)]
            pages = write_tree_pages(trees, out / "tree_pages")
            if logger:
                log_to_mlflow(summaries, logger, [*files.values(), *pages])
    finally:
        pool.close()
    lines = [f"  {'results':<12} {out / 'results'}  (one row per problem and setting)"]
    lines += [f"  {label:<12} {path}" for label, path in files.items()]
    if pages:
        lines.append(f"  {'tree pages':<12} {out / 'tree_pages'}  ({len(pages)} pages)")
    lines += tracker_lines(logger)
    print("Wrote:\n" + "\n".join(lines), flush=True)
    return summaries


def dataset_name(cfg: DictConfig) -> str:
    """The eval data as the user picked it (``data=humaneval``), else its loader's name."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            chosen = HydraConfig.get().runtime.choices.get("data")
            if chosen:
                return str(chosen)
    except (ImportError, ValueError):
        pass
    return str(cfg.data.eval.get("_target_", "?")).rsplit(".", 1)[-1].removeprefix("load_")


def weights(cfg: DictConfig) -> str:
    """Which weights the agents have: the checkpoint, reference answers, or untrained."""
    if uses_reference(cfg):
        return "none (reference solutions)"
    if cfg.get("ckpt_path"):
        return str(cfg.ckpt_path)
    return "UNTRAINED (no ckpt_path: the agents' initial weights)"


def run_metadata(cfg: DictConfig, settings: EvalSettings, problems: int) -> dict[str, Any]:
    """What an evaluation evaluated (results.json's "run")."""
    path = cfg.data.eval.get("path")
    return {
        "experiment": str(cfg.get("experiment_name")),
        "weights": weights(cfg),
        "dataset": dataset_name(cfg),
        "data_path": str(path) if path else None,
        "problems": problems,
        "samples": settings.samples,
        "temperature": settings.temperature,
        "tree_budget": settings.tree_budget,
        "seed": int(cfg.seed),
    }


def caption(cfg: DictConfig, settings: EvalSettings, problems: int) -> str:
    """What the table's numbers are of: the weights, the problems, n and the node budget."""
    answers = " (answers: reference solutions)" if uses_reference(cfg) else ""
    noun = "problem" if problems == 1 else "problems"
    return (
        f"{problems} {noun} of {dataset_name(cfg)}{answers}; weights: {weights(cfg)}; pass@k: "
        f"n={settings.samples} samples per problem at temperature {settings.temperature}; "
        f"trees: up to {settings.tree_budget} nodes; seed {cfg.seed}"
    )


def _natural(path: Path) -> list[Any]:
    """HumanEval_2 before HumanEval_10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.name)]


def tag_eval_run(logger: Any, cfg: DictConfig) -> None:
    """Name the eval's MLflow run with its dataset and link it to the training run and
    checkpoint it evaluates."""
    set_run_tag(logger, "mars2.dataset", dataset_name(cfg))
    set_run_tag(logger, "mars2.weights", weights(cfg))
    name = getattr(logger, "_run_name", None)
    if name:
        set_run_tag(logger, "mlflow.runName", f"{name}/{dataset_name(cfg)}")
    ckpt = cfg.get("ckpt_path")
    if not ckpt:
        return
    folder = Path(str(ckpt)).resolve().parent
    run = folder.parent if folder.name == "checkpoints" else folder
    set_run_tag(logger, "mars2.train_run_dir", str(run))
    record = run / "mlflow_run.json"
    if record.is_file():
        try:
            set_run_tag(logger, "mars2.train_run_id", str(json.loads(record.read_text())["run_id"]))
        except (OSError, ValueError, KeyError):
            pass


def _generators(
    cfg: DictConfig, problems: list[Any], settings: EvalSettings, pool: EnginePool
) -> dict[str, Any]:
    if uses_reference(cfg):
        return reference_generators(cfg, problems)
    return eval_generators(load_team(cfg), settings.temperature, pool)


def _evaluate(
    cfg: DictConfig,
    problems: list[Any],
    out: Path,
    settings: EvalSettings,
    generators: dict[str, Any],
) -> list[Summary]:
    base: SearchConfig = hydra.utils.instantiate(cfg.search.config, _convert_="all")
    search_config = SearchConfig(
        mode="tree",
        max_nodes=settings.tree_budget,
        expansions_per_round=base.expansions_per_round,
        policy=base.policy,
    )
    sandbox = builders.build_sandbox(cfg)
    try:
        # Metric verdicts on all tests; evaluate_tree gives the search only the public view.
        grader = builders.build_grader(cfg, sandbox, reward_tests="all")
        return run_evaluation(
            problems, generators, grader, search_config, settings.samples, out, cfg.seed,
            settings.chunk,
        )  # fmt: skip
    finally:
        sandbox.close()

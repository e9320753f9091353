"""Every experiment composes; bad overrides fail with Hydra's error (compose only, no model loading)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_all_required_experiments_exist() -> None:
    required = {
        "tiny_pair",
        "tiny_grpo",
        "qwen3_8b_grpo",
        "qwen3_8b_mars2",
        "qwen3_8b_areal8b_pair",
        "areal14b_pair",
    }
    assert required <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("config_name", ["train", "eval"])
def test_experiment_composes(experiment: str, config_name: str) -> None:
    cfg = _compose(config_name, [f"experiment={experiment}", "paths.output_dir=/tmp/unused"])
    assert cfg.experiment_name == experiment
    assert cfg.agents, "every experiment selects agents"
    for key, agent in cfg.agents.items():
        assert agent.name == key and agent._target_.endswith("AgentModule")
        assert OmegaConf.select(agent, "model.path")
    assert cfg.search._target_.endswith("TreeSearch")
    assert cfg.sandbox._target_.endswith("LocalSandbox")
    OmegaConf.to_container(cfg.agents, resolve=True)  # interpolations resolve


def test_pair_experiments_are_heterogeneous_teams() -> None:
    cfg = _compose("train", ["experiment=areal14b_pair"])
    assert set(cfg.agents) == {"areal_boba2_14b", "qwen3_14b"}
    assert cfg.agents.areal_boba2_14b.model.path == "inclusionAI/AReaL-boba-2-14B"
    assert cfg.agents.qwen3_14b.loss.beta == pytest.approx(
        1e-3
    ) and cfg.agents.qwen3_14b.optim.lr == pytest.approx(1e-6)
    grpo = _compose("train", ["experiment=qwen3_8b_grpo"])
    assert grpo.search.config.mode == "independent" and list(grpo.agents) == ["qwen3_8b"]


def test_agents_swap_by_override() -> None:
    cfg = _compose("train", ["experiment=tiny_pair", "agent=[tiny_llama]"])
    assert list(cfg.agents) == ["tiny_llama"]


@pytest.mark.parametrize("trainer", ["cpu", "gpu", "ddp", "fsdp"])
def test_trainer_groups_compose(trainer: str) -> None:
    cfg = _compose("train", ["experiment=tiny_pair", f"trainer={trainer}"])
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"


@pytest.mark.parametrize("logger", ["mlflow", "csv", "none"])
def test_logger_groups_compose(logger: str) -> None:
    cfg = _compose("train", ["experiment=tiny_pair", f"logger={logger}"])
    if logger == "none":
        assert cfg.logger is None
    elif logger == "mlflow":
        assert (
            str(cfg.logger.tracking_uri).startswith("sqlite:///")
            and "logs/mlflow" in cfg.logger.tracking_uri
        )


def _train_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(REPO / "src/mars2/train.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_prints_resolved_job_config() -> None:
    result = _train_cli("--cfg", "job", "experiment=tiny_pair")
    assert result.returncode == 0, result.stderr
    assert "experiment_name: tiny_pair" in result.stdout and "tiny_llama" in result.stdout


def test_cli_bad_override_fails_with_hydra_error() -> None:
    result = _train_cli("experiment=tiny_pair", "trainer=nope")
    assert result.returncode != 0
    assert "Could not find 'trainer/nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_agent_lists_every_loss_field() -> None:
    """So that `agents.<a>.loss.<field>=...` is a plain override (no `+`) for every field."""
    from dataclasses import fields

    from mars2.training.losses import LossConfig

    names = {f.name for f in fields(LossConfig)}
    for path in sorted((CONFIGS / "agent").glob("*.yaml")):
        loss = OmegaConf.load(path).loss
        assert set(loss) - {"_target_"} == names, path.name


def test_one_overlong_knob_per_agent() -> None:
    cfg = _compose("train", ["experiment=tiny_pair"])
    assert "overlong_penalty" not in cfg and "overlong_penalty" not in cfg.rollout
    import inspect

    from mars2.training.rollout import RolloutEngine

    assert "overlong_penalty" not in inspect.signature(RolloutEngine).parameters


@pytest.mark.parametrize("experiment", ["tiny_grpo", "qwen3_8b_grpo"])
def test_grpo_baselines_do_not_shape(experiment: str) -> None:
    cfg = _compose("train", [f"experiment={experiment}"])
    assert cfg.search.config.mode == "independent" and cfg.advantage.gamma == 0.0
    assert _compose("train", ["search=grpo"]).advantage.gamma == 0.0


def test_independent_sampling_with_shaping_is_refused() -> None:
    from mars2.rewards.routing import AdvantageConfig
    from mars2.search.runner import SearchConfig, TreeSearch
    from mars2.search.simulated import SimulatedGrader, simulated_problems
    from mars2.training.rollout import ProblemSchedule, RolloutEngine

    schedule = ProblemSchedule(simulated_problems(2), per_step=1, seed=0)
    search = TreeSearch(SearchConfig(mode="independent"))
    with pytest.raises(ValueError, match="gamma"):
        RolloutEngine(schedule, search, SimulatedGrader(), AdvantageConfig(gamma=0.5))
    RolloutEngine(schedule, search, SimulatedGrader(), AdvantageConfig(gamma=0.0))


def test_a_resumed_run_redoes_the_warm_start_only_for_its_kl_reference() -> None:
    """The checkpoint brings the trained policy; a KL reference (never checkpointed) is the
    warm-started policy, so it is rebuilt by the same seeded warm start."""
    from mars2.training.run import warm_start_needed

    base = ["experiment=tiny_pair"]
    assert warm_start_needed(_compose("train", base))
    assert not warm_start_needed(_compose("train", [*base, "ckpt_path=x.ckpt"]))
    kl = "agents.tiny_qwen3.loss.beta=0.01"
    assert warm_start_needed(_compose("train", [*base, "ckpt_path=x.ckpt", kl]))
    assert not warm_start_needed(_compose("train", [*base, "warm_start=null", kl]))

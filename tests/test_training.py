"""Training on the tiny agents: per-agent updates, idle agents, resume, MLflow, DDP on 2 CPU processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir

from mars2.data.toy import toy_problems
from mars2.generation.transformers_backend import ScriptedGenerator
from mars2.search.tree import load_trees
from mars2.training.agent_module import AgentModule, optimise_agent
from mars2.training.batching import micro_batches
from mars2.training.rollout import RolloutEngine
from mars2.training.run import build_run

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
REFERENCE = {p.statement: p.metadata["reference_solution"] for p in toy_problems()}


def scripted_answer(chat: list[dict[str, str]]) -> str:
    """Right or wrong, decided by a hash of the prompt: mixed rewards, reproducible across runs."""
    text = chat[-1]["content"]
    statement = next(s for s in REFERENCE if s in text)
    right = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 2 == 0
    code = REFERENCE[statement] if right else "print('nope')\n"
    return f"Here it is.\n```python\n{code}```"


def compose_run(tmp: Path, tiny: Path, *overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "experiment=tiny_pair",
                "data=toy",
                "warm_start=null",
                f"paths.output_dir={tmp}",
                f"paths.tiny_models_dir={tiny}",
                f"paths.log_dir={tmp}/logs",
                "~callbacks.progress",
                "problems_per_step=2",
                "search.config.max_nodes=6",
                "sandbox.num_workers=2",
                "+trainer.enable_progress_bar=false",
                *overrides,
            ],
        )
    return cfg


def snapshot(agent: AgentModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.policy.state_dict().items()}


def changed(before: dict[str, torch.Tensor], agent: AgentModule) -> bool:
    return any(not torch.equal(before[k], v) for k, v in agent.policy.state_dict().items())


def script_all(module: Any) -> None:
    for agent in module.agents.values():
        agent.generator = ScriptedGenerator(agent.tokenizer, scripted_answer)


def test_one_step_updates_each_agent_with_only_its_own_nodes(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    cfg = compose_run(
        tmp_path,
        tiny_models_dir,
        "steps=1",
        "logger=mlflow",
        "callbacks.checkpoint.every_n_train_steps=1",
    )
    module, datamodule, trainer, sandbox = build_run(cfg)
    script_all(module)
    before = {name: snapshot(agent) for name, agent in module.agents.items()}
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    data = datamodule.last
    for name, agent in module.agents.items():
        samples = data.samples[name]
        assert samples, f"{name} made no trainable nodes"
        assert all(s.agent == name for s in samples)
        owners = {data.trees[s.tree_index].nodes[s.node_id].agent for s in samples}
        assert owners == {name}
        assert changed(before[name], agent)

        # Replaying this agent's own samples alone from its starting weights gives the same weights:
        # nothing from the other agent's nodes went into its update.
        replica = AgentModule(
            name,
            agent.model_spec,
            agent.generation_config,
            agent.optim_config,
            agent.loss_config,
            agent.micro_batch_size,
        )
        replica.policy.load_state_dict(before[name])
        optimizer, scheduler = replica.build_optimizer()
        batches = micro_batches(samples, agent.micro_batch_size, agent.tokenizer.pad_token_id)
        optimise_agent(
            replica, optimizer, scheduler, batches, lambda loss: loss.backward(), len(samples)
        )
        for key, value in agent.policy.state_dict().items():
            torch.testing.assert_close(
                replica.policy.state_dict()[key], value, rtol=1e-5, atol=1e-6
            )

    # MLflow got the run, its params, per-agent metrics and the tree artifacts; a checkpoint exists.
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=cfg.logger.tracking_uri)
    run = client.get_run(trainer.logger.run_id)
    assert run.data.params["experiment_name"] == "tiny_pair"
    assert {"tiny_qwen3/expansion_share", "tiny_llama/loss", "solve_rate"} <= set(run.data.metrics)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "trees")]
    views = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "views")}
    assert "overview.png" in views and any(v.endswith(".html") for v in views)
    assert list(
        (tmp_path / "logs" / "mlflow" / "artifacts").rglob("overview.png")
    )  # under logs/, not ./mlruns
    assert list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert (tmp_path / "agents" / "tiny_llama" / "config.json").exists()


class _QwenOnly(RolloutEngine):
    """Routes nothing to tiny_llama, as when an agent produced no nodes in a step."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        data = super().run(*args, **kwargs)
        data.samples["tiny_llama"] = []
        return data


def test_agent_without_nodes_is_untouched(tmp_path: Path, tiny_models_dir: Path) -> None:
    cfg = compose_run(
        tmp_path, tiny_models_dir, "steps=1", "logger=none", "callbacks.checkpoint=null"
    )
    module, datamodule, trainer, sandbox = build_run(cfg)
    engine = datamodule.engine
    datamodule.engine = _QwenOnly(engine.schedule, engine.search, engine.grader, engine.advantages)
    script_all(module)
    before = {name: snapshot(agent) for name, agent in module.agents.items()}
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    assert changed(before["tiny_qwen3"], module.agents["tiny_qwen3"])
    assert not changed(before["tiny_llama"], module.agents["tiny_llama"])
    llama_optimizer = trainer.optimizers[module.agent_names.index("tiny_llama")]
    assert not llama_optimizer.state  # never stepped: no Adam moments either
    # ... but its LR schedule moved on with the team step, so it still ends with the run.
    for config in trainer.lr_scheduler_configs:
        assert config.scheduler.last_epoch == 1


def _resume_run(tmp: Path, tiny: Path, *overrides: str) -> tuple[Any, Any]:
    cfg = compose_run(
        tmp,
        tiny,
        "steps=2",
        "logger=none",
        "callbacks.checkpoint.every_n_train_steps=1",
        *overrides,
    )
    module, datamodule, trainer, sandbox = build_run(cfg)
    llama = module.agents["tiny_llama"]
    llama.generator = ScriptedGenerator(llama.tokenizer, scripted_answer)  # qwen samples for real
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    finally:
        sandbox.close()
    return module, datamodule


def test_resume_reproduces_the_next_batch(tmp_path: Path, tiny_models_dir: Path) -> None:
    first = tmp_path / "first"
    _resume_run(first, tiny_models_dir)
    checkpoint = next(
        p for p in (first / "checkpoints").glob("*.ckpt") if p.name == "step_000001.ckpt"
    )
    second = tmp_path / "second"
    _, datamodule = _resume_run(second, tiny_models_dir, f"ckpt_path={checkpoint}")
    assert datamodule.last.step == 1
    # The LR schedules came back with the checkpoint: two team steps, one of them before it.
    for config in datamodule.trainer.lr_scheduler_configs:
        assert config.scheduler.last_epoch == 2
    assert not (second / "trees" / "step_000001_rank0.jsonl").exists()  # step 1 was not redone
    original = load_trees(first / "trees" / "step_000002_rank0.jsonl")
    resumed = load_trees(second / "trees" / "step_000002_rank0.jsonl")
    assert [t.problem.id for t in resumed] == [t.problem.id for t in original]
    assert [[n.completion for n in t.answers()] for t in resumed] == [
        [n.completion for n in t.answers()] for t in original
    ]
    assert [[n.agent for n in t.answers()] for t in resumed] == [
        [n.agent for n in t.answers()] for t in original
    ]


_WALL_CLOCK = ("seconds", "per_s", "busy")  # timings differ between any two runs


def _history_and_state(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Any]]:
    """Every metric's (step, value) points in the run's MLflow run, and its last checkpoint."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder}/logs/mlflow/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("mars2-train").experiment_id])
    history = {
        key: sorted((p.step, p.value) for p in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
        if not any(word in key for word in _WALL_CLOCK)
    }
    return history, torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)


def _fit(folder: Path, tiny: Path, *overrides: str) -> None:
    cfg = compose_run(
        folder, tiny, "logger=mlflow", "callbacks.checkpoint.every_n_train_steps=1",
        "problems_per_step=1", "search.config.max_nodes=2",
        *overrides,
    )  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    llama = module.agents["tiny_llama"]
    llama.generator = ScriptedGenerator(llama.tokenizer, scripted_answer)  # qwen samples for real
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    finally:
        sandbox.close()


def test_resume_at_a_step_boundary_is_bit_exact(tmp_path: Path, tiny_models_dir: Path) -> None:
    """A run stopped after step k (trainer.max_steps=k) and resumed from its last.ckpt ends with the
    same metric histories (wall-clock figures aside), weights, optimizer states and datamodule
    state as the uninterrupted run. k is the first step at which an agent that had trained
    sits out (its tree is degenerate): Lightning used to log that agent's previous step's values
    again there, which a run resumed at k never saw."""
    steps = 5
    whole = tmp_path / "whole"
    _fit(whole, tiny_models_dir, f"steps={steps}")
    history, state = _history_and_state(whole)
    stepped = {key.split("/")[0]: dict(points) for key, points in history.items()
               if key.endswith("/stepped")}  # fmt: skip
    assert set(stepped) == {"tiny_qwen3", "tiny_llama"}
    # Steps are numbered from 1 in the histories: step k is the one after k - 1 done.
    idle = [k for k in range(2, steps + 1)
            if any(v[k] == 0 and any(v[e] for e in range(1, k)) for v in stepped.values())]  # fmt: skip
    assert idle, f"no agent sat a step out after training in this run ({stepped}): pick a seed"

    cut, done = tmp_path / "cut", idle[0] - 1  # stop just before the idle step; resume runs it
    _fit(cut, tiny_models_dir, f"steps={steps}", f"trainer.max_steps={done}")
    assert torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == done
    _fit(cut, tiny_models_dir, f"steps={steps}", f"ckpt_path={cut}/checkpoints/last.ckpt")
    resumed_history, resumed = _history_and_state(cut)
    assert resumed_history == history
    for agent, points in stepped.items():  # an agent's losses only at the steps it trained
        assert [s for s, _ in history[f"{agent}/loss"]] == [s for s, v in points.items() if v]
    assert resumed["global_step"] == state["global_step"] == steps
    assert resumed["state_dict"].keys() == state["state_dict"].keys()
    for key, value in state["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    for mine, theirs in zip(resumed["optimizer_states"], state["optimizer_states"], strict=True):
        assert mine["state"].keys() == theirs["state"].keys()
        for index, moments in theirs["state"].items():
            for name, value in moments.items():
                assert torch.equal(mine["state"][index][name], value), (index, name)
    assert resumed["TreeSearchDataModule"] == state["TreeSearchDataModule"]
    norms = [v for key, points in history.items() if key.endswith("/grad_norm") for _, v in points]
    assert max(norms) > 0  # the agents trained: equal weights mean something


def test_ddp_on_two_cpu_processes_runs_two_steps(tmp_path: Path, tiny_models_dir: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MARS2_TINY_MODELS": str(tiny_models_dir)}
    command = [
        sys.executable, str(REPO / "src/mars2/train.py"), "experiment=tiny_pair", "debug=fast",
        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "logger=csv", "advantage.filter_degenerate=false", "sandbox.num_workers=1",
        "~callbacks.progress", "+trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for step in (1, 2):
        for rank in (0, 1):
            trees = load_trees(tmp_path / "trees" / f"step_{step:06d}_rank{rank}.jsonl")
            assert len(trees) == 2
    rank0 = {t.problem.id for t in load_trees(tmp_path / "trees" / "step_000001_rank0.jsonl")}
    rank1 = {t.problem.id for t in load_trees(tmp_path / "trees" / "step_000001_rank1.jsonl")}
    assert not rank0 & rank1  # each rank grew its own slice of the step's problems
    assert (tmp_path / "agents" / "tiny_qwen3" / "config.json").exists()


def test_overlong_penalty_with_global_statistics_runs_to_the_end(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    """The issue's "done when": every answer is cut at 8 tokens (penalty -1) and the search carries
    agent statistics across steps; they must hold raw rewards only (it used to fail at step 2)."""
    overrides = [
        f"agents.{name}.{key}"
        for name in ("tiny_qwen3", "tiny_llama")
        for key in (
            "loss.overlong_buffer=4",
            "loss.overlong_penalty=1",
            "generation.max_new_tokens=8",
        )
    ]
    cfg = compose_run(
        tmp_path, tiny_models_dir, "search=mars2_global", "steps=3", "logger=none",
        "callbacks.checkpoint=null", "advantage.filter_degenerate=false", *overrides,
    )  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    assert trainer.global_step == 3
    data = datamodule.last
    assert data.step == 2
    nodes = [n for t in data.trees for n in t.answers()]
    assert nodes and all(n.truncated for n in nodes)
    assert all(0.0 <= n.reward <= 1.0 for n in nodes)
    samples = [s for batch in data.samples.values() for s in batch]
    assert samples and all(s.length_term == -1.0 for s in samples)
    for stats in datamodule.engine.agent_statistics.stats.values():
        assert 0.0 <= stats.total <= stats.count


def _statistics_rank(rank: int, out: str) -> None:
    from mars2.search.policy import AgentStatistics
    from mars2.training.distributed import sum_across_ranks
    from tests.test_search import _grow

    statistics = AgentStatistics(decay=0.5)
    for step in range(2):
        trees = _grow(step)
        mine = trees[:2] if rank == 0 else trees[2:]  # uneven on purpose
        statistics.update(mine, agents=["a", "b"], reduce=sum_across_ranks)
    torch.save(statistics.state_dict(), f"{out}.{rank}")


def test_agent_statistics_are_summed_over_two_gloo_ranks(tmp_path: Path) -> None:
    from mars2.search.policy import AgentStatistics
    from tests.ranks import on_two_gloo_ranks
    from tests.test_search import _grow

    out = str(tmp_path / "stats.pt")
    on_two_gloo_ranks(_statistics_rank, out)
    alone = AgentStatistics(decay=0.5)
    for step in range(2):
        alone.update(_grow(step))
    states = [torch.load(f"{out}.{rank}") for rank in (0, 1)]
    assert states[0] == states[1]  # every rank, rank 0 (the one that checkpoints) included
    for name, stats in alone.state_dict()["stats"].items():
        assert states[0]["stats"][name] == pytest.approx(stats)


def test_without_a_terminal_progress_is_one_line_per_step(caplog) -> None:
    """A batch job's log holds one line per step (step, reward, solve rate, loss per agent, time),
    not a bar's carriage-return frames; the warm start one line per epoch."""
    import logging
    from types import SimpleNamespace

    import torch

    from mars2.training.progress import StepProgressBar, warm_start_bar

    bar = StepProgressBar(lines=True)
    assert bar.is_disabled
    trainer = SimpleNamespace(
        max_steps=20, datamodule=SimpleNamespace(next_step=3),
        callback_metrics={"reward": torch.tensor(0.5), "solve_rate": torch.tensor(0.25),
                          "tiny_qwen3/loss": torch.tensor(0.125), "tiny_llama/loss": torch.tensor(1.5),
                          "tiny_qwen3/kl": torch.tensor(0.0)},
    )  # fmt: skip
    bar._trainer = trainer  # type: ignore[assignment]
    line = bar.step_line(trainer)  # type: ignore[arg-type]
    assert line.startswith("step 3/20, reward 0.500, solve rate 0.250, ")
    assert "loss tiny_qwen3 0.1250 tiny_llama 1.5000" in line and "kl" not in line
    with (
        caplog.at_level(logging.INFO, logger="mars2.training.progress"),
        warm_start_bar("tiny_qwen3", 2) as show,
    ):
        show(0.5)
        show(0.25)
    epochs = [r.getMessage() for r in caplog.records if "warm start" in r.getMessage()]
    assert len(epochs) == 2 and "epoch 2/2, loss 0.2500" in epochs[1]


def _run_in_a_terminal(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Runs `command` with a pseudo-terminal of 40x160 as its stdin, stdout and stderr (a user's
    terminal: tqdm draws nothing in a terminal of width 0); returns its exit code and output."""
    import fcntl
    import pty
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
            os.chdir(cwd)
            os.execve(command[0], command, env)
        finally:
            os._exit(127)
    output = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output.extend(chunk)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode("utf-8", "replace")


def test_in_a_terminal_the_bar_is_drawn_in_place_once_and_logs_get_their_own_lines(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    """A user's terminal: one training bar, redrawn in place (carriage returns) from `0/2` (never
    `0/?`), finished before the end-of-run lines and never drawn again below them; every log line
    (Lightning's `Trainer.fit` stopped, the saved agents) starts a line of its own."""
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TERM": "xterm"}
    command = [
        sys.executable, str(Path(__file__).resolve().parents[1] / "src/mars2/train.py"),
        "experiment=tiny_pair", "debug=fast", "steps=2", "data=toy",
        f"paths.log_dir={tmp_path / 'logs'}", f"paths.tiny_models_dir={tiny_models_dir}",
        "sandbox.num_workers=1", "problems_per_step=1", "search.config.max_nodes=2",
        "agents.tiny_qwen3.generation.max_new_tokens=8",
        "agents.tiny_llama.generation.max_new_tokens=8",
    ]  # fmt: skip
    code, output = _run_in_a_terminal(command, tmp_path, env)
    assert code == 0, output[-3000:]
    lines = output.replace("\r\n", "\n").split("\n")
    bar_lines = [line for line in lines if "Training" in line and "%|" in line]
    assert len(bar_lines) == 1, lines  # one bar, on one line of the terminal
    frames = [frame for frame in bar_lines[0].split("\r") if frame]
    assert len(frames) >= 2, frames  # redrawn in place, not one line per frame
    assert "0/2" in frames[0] and "/?" not in bar_lines[0], frames[0]
    assert "2/2" in frames[-1], frames[-1]
    stopped = next(i for i, line in enumerate(lines) if "`Trainer.fit` stopped" in line)
    assert lines[stopped].startswith("["), lines[stopped]  # its own line, not glued to the bar
    assert lines.index(bar_lines[0]) < stopped
    saved = [line for line in lines if "saved agent" in line]
    assert len(saved) == 2 and all(line.startswith("[") for line in saved), saved

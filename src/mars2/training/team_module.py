"""The team: every agent as a child of one top-level module, each stepping on its own nodes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch

from mars2.training.agent_module import AgentModule, advance_schedule, optimise_agent
from mars2.training.distributed import agent_step_route, global_counts
from mars2.training.members import forget_earlier_steps, is_trainable, next_batch


class MultiAgentModule(pl.LightningModule):
    """One Lightning Trainer drives this module; it holds the agents and steps each one separately.

    Frozen teammates (``trainable: false``, `mars2.training.teammate.FrozenAgent`) are members of
    the team (`members`: they expand nodes) but not of the module: no optimizer, no loss, nothing
    of them in the checkpoint; an in-process one's policy follows the team's device.

    Manual optimisation: for every agent with samples this step (on any rank) its own optimizer
    takes its steps on its own micro-batches (``optim.ppo_epochs`` x ``optim.mini_batches`` per
    rollout); an agent with none keeps its weights and optimizer state (its LR schedule, which
    counts team steps, moves on).
    """

    def __init__(self, agents: Mapping[str, Any]) -> None:
        super().__init__()
        if not agents:
            raise ValueError("a team needs at least one agent")
        for key, agent in agents.items():
            if key != agent.name:
                raise ValueError(f"agent registered as {key!r} is named {agent.name!r}")
        trained = {k: a for k, a in agents.items() if is_trainable(a)}
        self.agents = torch.nn.ModuleDict(trained)
        self.agent_names = list(trained)
        # a plain dict: outside the module tree, so out of state_dict, optimizers and DDP
        self.teammates: dict[str, Any] = {k: a for k, a in agents.items() if not is_trainable(a)}
        self.member_names = list(agents)  # the configured order (the search's first expansions)
        self.automatic_optimization = False

    def agent(self, name: str) -> AgentModule:
        """The trained team member called `name`."""
        return cast(AgentModule, self.agents[name])

    def members(self) -> dict[str, Any]:
        """Every member, trained agents and frozen teammates, in the configured order."""
        return {n: self.teammates[n] if n in self.teammates else self.agents[n]
                for n in self.member_names}  # fmt: skip

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # .to(device) and dtype casts of the team reach the frozen in-process policies too
        super()._apply(fn, *args, **kwargs)
        for teammate in getattr(self, "teammates", {}).values():
            if teammate.policy is not None:
                teammate.policy._apply(fn)
        return self

    def configure_optimizers(self) -> Any:
        if not self.agent_names:
            raise ValueError(
                f"every agent of the team is frozen ({', '.join(self.teammates)}): there is "
                "nothing to train; set trainable: true for one (mars2-eval evaluates a frozen team)"
            )
        optimizers, schedulers = [], []
        for name in self.agent_names:
            optimizer, scheduler = self.agent(name).build_optimizer()
            optimizers.append(optimizer)
            schedulers.append({"scheduler": scheduler, "interval": "step"})
        return optimizers, schedulers

    def _count_step(self) -> None:
        # Lightning counts one global step per optimizer.step() in manual mode; a team step is one
        # step however many agents moved, so max_steps and checkpoint intervals mean team steps.
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    def training_step(self, dataloader_iter: Iterator[Any]) -> None:
        batch = next_batch(self, dataloader_iter)
        forget_earlier_steps(self)
        optimizers: Any = self.optimizers(use_pl_optimizer=False)
        schedulers: Any = self.lr_schedulers()
        if not isinstance(optimizers, list):
            optimizers, schedulers = [optimizers], [schedulers]
        local = [int(batch["counts"].get(name, 0)) for name in self.agent_names]
        total = global_counts(local, self.device)
        logged: dict[str, float] = {}
        for index, name in enumerate(self.agent_names):
            if total[index] == 0:
                logged[f"{name}/stepped"] = 0.0
                advance_schedule(schedulers[index])  # its schedule still counts the team step
                continue
            agent = self.agent(name)
            backward, sync, pad = agent_step_route(agent, self.manual_backward)
            metrics = optimise_agent(
                agent, optimizers[index], schedulers[index], batch["agents"].get(name, []),
                backward, local[index], sync_gradients=sync,
                global_sizes=lambda sizes: global_counts(sizes, self.device), pad=pad,
            )  # fmt: skip
            logged[f"{name}/stepped"] = 1.0
            logged.update({f"{name}/{key}": value for key, value in metrics.items()})
        self._count_step()
        for key, value in batch.get("metrics", {}).items():
            logged[key] = float(value)
        # The loggers' x-axis: the step's number (1 for the first), as the progress line, the
        # tree file and the checkpoint name show it (Lightning would use the 0-based batch count).
        logged["step"] = float(self.trainer.global_step)
        bar = ("reward", "solve_rate", "generator_busy", "sandbox_busy")
        shown: dict[str, Any] = {k: logged[k] for k in bar if k in logged}
        self.log_dict(shown, prog_bar=True, batch_size=1)
        self.log_dict({k: v for k, v in logged.items() if k not in shown}, batch_size=1)

    def save_agents(self, directory: str) -> None:
        """Every trained agent in Hugging Face format under `directory/<name>`."""
        for name in self.agent_names:
            self.agent(name).save_pretrained(f"{directory}/{name}")

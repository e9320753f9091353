"""In-flight updates with bounded staleness (`max_staleness`, issue #44 point 3).

max_staleness=0 is compared against a run of the code before max_staleness existed (commit
`BEFORE_STALENESS`, exported from git in the same test run; skipped where the clone lacks it); the
one-step off-policy runs train the tiny agents for real on CPU (transformers backend on its own
copy of the weights, a scripted teammate for mixed rewards); the rest are unit checks of the
version bookkeeping and the refusals. Nothing is mocked except the trainer a datamodule reads its
team from in the unit checks.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from mars2.generation.base import Completion
from mars2.generation.factory import (
    ServedGenerator,
    StaleWeightsError,
    StreamingServedGenerator,
)
from mars2.generation.transformers_backend import ScriptedGenerator, TransformersGenerator
from mars2.search.tree import load_trees
from mars2.training.datamodule import StalenessError, TreeSearchDataModule
from tests.test_training import compose_run, scripted_answer

REPO = Path(__file__).resolve().parents[1]
OFF_POLICY = ("search.config.driver=pipelined", "max_staleness=1")


# -- unit checks --------------------------------------------------------------------------------


class _Backend:
    """A weightless backend that answers every chat with one token (a stand-in sampler)."""

    overlaps_updates = True

    def __init__(self) -> None:
        self.max_in_flight = 4

    def sync_weights(self, policy: Any) -> None:
        pass

    def generate(self, chats: list[Any]) -> list[Completion]:
        return [Completion(text="x", token_ids=[1], prompt_token_ids=[0]) for _ in chats]

    def submit(self, chats: list[Any], done: Any) -> None:
        for index, completion in enumerate(self.generate(chats)):
            done(index, completion)


def _source(name: str = "a") -> SimpleNamespace:
    return SimpleNamespace(name=name, weights_version=0, policy=None,
                           generation_config=None)  # fmt: skip


def test_served_generator_stamps_versions_and_counts_staleness() -> None:
    source = _source()
    generator = StreamingServedGenerator(source, _Backend(), served_version=0)
    assert [c.weights_version for c in generator.generate([[]])] == [0]
    source.weights_version = 3  # e.g. three optimizer steps in one team step
    with pytest.raises(StaleWeightsError):  # on-policy: never from older weights
        generator.generate([[]])
    generator.sync()
    got: list[Any] = []
    generator.submit([[], []], lambda i, c: got.append((i, c.weights_version)))
    assert got == [(0, 3), (1, 3)]
    source.weights_version = 5
    generator.sync()
    # Staleness counts the weight updates pushed after the sample's version, not optimizer steps.
    assert [generator.staleness(v) for v in (5, 3, 0)] == [0, 1, 2]
    with pytest.raises(ValueError, match="without a weights version"):
        generator.staleness(None)


def test_hold_floor_lets_the_generator_lag_only_during_the_update() -> None:
    source = _source()
    generator = ServedGenerator(source, _Backend(), served_version=0)
    source.weights_version = 1
    with pytest.raises(StaleWeightsError):  # a boundary with an unsynced update: refused
        generator.hold_floor()
    generator.sync()
    generator.hold_floor()
    source.weights_version = 2  # the trainer updates while the next rollout samples
    assert [c.weights_version for c in generator.generate([[]])] == [1]
    generator.floor = 2  # a floor the sampler never reached (an update never synced)
    with pytest.raises(StaleWeightsError, match="never synced"):
        generator.generate([[]])


def test_transformers_generator_overlaps_updates_only_on_its_own_copy() -> None:
    policy = torch.nn.Linear(2, 2)
    shared = TransformersGenerator(policy, tokenizer=None)
    shared.sync_weights(policy)
    assert not shared.overlaps_updates
    copy = TransformersGenerator(torch.nn.Linear(2, 2), tokenizer=None)
    copy.sync_weights(policy)
    assert copy.overlaps_updates
    assert torch.equal(copy.model.weight, policy.weight)
    assert ScriptedGenerator(None, scripted_answer).overlaps_updates


def _engine(driver: str = "pipelined") -> Any:
    return SimpleNamespace(search=SimpleNamespace(config=SimpleNamespace(driver=driver)),
                           agent_statistics=None)  # fmt: skip


def _with_team(
    datamodule: TreeSearchDataModule, generators: dict[str, Any], world: int = 1
) -> None:
    agents = {name: SimpleNamespace(generator=g) for name, g in generators.items()}
    datamodule.trainer = SimpleNamespace(world_size=world, global_rank=0,  # type: ignore[assignment]
                                         lightning_module=SimpleNamespace(agents=agents))  # fmt: skip


def test_max_staleness_refusals() -> None:
    with pytest.raises(ValueError, match="larger bounds are not built"):
        TreeSearchDataModule(_engine(), max_staleness=2)
    with pytest.raises(ValueError, match="driver=pipelined"):
        TreeSearchDataModule(_engine("rounds"), max_staleness=1)
    TreeSearchDataModule(_engine("rounds"), max_staleness=0)  # on-policy: any driver
    datamodule = TreeSearchDataModule(_engine(), max_staleness=1)
    on_policy = TransformersGenerator(torch.nn.Linear(2, 2), tokenizer=None)
    on_policy.sync_weights(on_policy.model)  # samples with the policy itself
    _with_team(datamodule, {"a": ServedGenerator(_source(), on_policy, served_version=0)})
    with pytest.raises(ValueError, match=r"\['a'\] \(TransformersGenerator\) cannot generate"):
        next(datamodule.in_flight_batches())
    _with_team(datamodule, {"a": ServedGenerator(_source(), _Backend(), served_version=0)}, 2)
    with pytest.raises(ValueError, match="one process only"):
        next(datamodule.in_flight_batches())


def test_a_sample_beyond_the_bound_is_refused() -> None:
    source = _source()
    generator = ServedGenerator(source, _Backend(), served_version=0)
    datamodule = TreeSearchDataModule(_engine(), max_staleness=1)
    _with_team(datamodule, {"a": generator})

    def data(version: int) -> Any:
        completion = Completion(text="x", weights_version=version)
        sample = SimpleNamespace(node=SimpleNamespace(completion=completion))
        return SimpleNamespace(step=7, samples={"a": [sample]})

    for version in (1, 2):
        source.weights_version = version
        generator.sync()
    assert datamodule._handed(data(1))["a/stale_share"] == 1.0  # one update old: trained on
    with pytest.raises(StalenessError, match="2 weight updates older"):
        datamodule._handed(data(0))


# -- max_staleness=0 is today's behaviour, bit for bit --------------------------------------------


# main just before max_staleness was merged: the behaviour max_staleness=0 must keep bit for bit.
# Move it only to a commit without max_staleness, when training changes on purpose.
BEFORE_STALENESS = os.environ.get("MARS2_STALENESS_BASE", "2a8e170")


def _export_before(target: Path) -> bool:
    """`BEFORE_STALENESS`'s src, tests and configs exported to `target` (False if not in git)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", BEFORE_STALENESS,
                              "src", "tests", "configs"], capture_output=True)  # fmt: skip
    if archive.returncode != 0:
        return False
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="tar")
    return True


def _export_here(target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    for part in ("src", "tests", "configs"):
        shutil.copytree(REPO / part, target / part, symlinks=True, ignore=ignore)


def _recorded_run(root: Path, out: Path, tmp: Path, tiny: Path, *overrides: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "MARS2_CHECKOUT": str(root)}
    subprocess.run([sys.executable, str(REPO / "tests" / "staleness_run.py"), str(out), str(tmp),
                    str(tiny), "steps=2", *overrides], check=True, env=env,
                   capture_output=True)  # fmt: skip
    return torch.load(out, weights_only=False)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        if where.endswith(("/metrics", "/logged")):  # metrics added since (prompts_cut) may join
            assert a.keys() <= b.keys(), (where, a.keys() - b.keys())
        else:
            assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_max_staleness_0_trains_exactly_as_before(tmp_path: Path, tiny_models_dir: Path) -> None:
    """Two steps with each driver (rounds; pipelined on the virtual clock), run by the code before
    max_staleness and by this checkout with max_staleness=0: the same batches, metrics and final
    weights."""
    # Both runs from the same folder: graders' tracebacks quote the checkout's path, and the
    # scripted teammate's answers depend on the prompts that show them.
    checkout, runs = tmp_path / "checkout", tmp_path / "runs"
    if not _export_before(checkout):
        pytest.skip(f"commit {BEFORE_STALENESS} is not in this clone (a shallow clone?)")
    before = _recorded_run(checkout, tmp_path / "main.pt", runs, tiny_models_dir)
    shutil.rmtree(checkout)
    shutil.rmtree(runs)
    _export_here(checkout)
    now = _recorded_run(checkout, tmp_path / "now.pt", runs, tiny_models_dir, "max_staleness=0")
    for driver in ("rounds", "pipelined"):  # two steps, the sampling agent trained at both
        assert [len(s["agents"]["tiny_qwen3"]) > 0 for s in now[driver]["steps"]] == [True] * 2
    _assert_same(before, now)


# -- one-step off-policy, trained for real ---------------------------------------------------------


class _Handed(pl.Callback):
    """What the trainer got at each step: the step, its problems and its staleness metrics."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[str], dict[str, float]]] = []
        self.versions: list[int] = []  # tiny_qwen3's weights version at the start, after each step

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.versions.append(int(pl_module.agents["tiny_qwen3"].weights_version))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        data = trainer.datamodule.last  # type: ignore[attr-defined]
        self.steps.append((data.step, [t.problem.id for t in data.trees], dict(data.metrics)))
        self.versions.append(int(pl_module.agents["tiny_qwen3"].weights_version))


class _SlowUpdate(pl.Callback):
    """Holds the trainer 2 s before each update, so the next step's rollout (started when the
    batch was handed over) surely sends requests before the weights change, even on a loaded
    machine where the rollout thread may otherwise get no CPU until the sync is done."""

    def on_train_batch_start(self, *args: Any) -> None:
        time.sleep(2.0)


def _off_policy_run(
    tmp: Path, tiny: Path, *overrides: str, slow_update: bool = False
) -> tuple[Any, Any, _Handed]:
    from mars2.training.run import build_run

    cfg = compose_run(tmp, tiny, "logger=none", *OFF_POLICY, *overrides)
    module, datamodule, trainer, sandbox = build_run(cfg)
    llama = module.agents["tiny_llama"]
    llama.generator = ScriptedGenerator(llama.tokenizer, scripted_answer)  # qwen samples for real
    handed = _Handed()
    trainer.callbacks.append(handed)
    if slow_update:
        trainer.callbacks.append(_SlowUpdate())
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    finally:
        sandbox.close()
    return module, trainer, handed


@pytest.mark.slow
def test_one_step_off_policy_trains_on_samples_at_most_one_update_old(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    module, trainer, handed = _off_policy_run(tmp_path, tiny_models_dir, "steps=4",
                                              "callbacks.checkpoint=null",
                                              slow_update=True)  # fmt: skip
    assert [step for step, _, _ in handed.steps] == [0, 1, 2, 3]
    assert module.agents["tiny_qwen3"].off_policy_samples
    # Step k's rollout ran while the trainer updated on step k - 1: a sample of it can be stale
    # only when that update changed tiny_qwen3 (an agent whose groups were all-equal sits a step
    # out), and never more than one update old. Whether its requests went out before the sync
    # is timing (on a loaded CPU the search may grade the teammate's answers for longer than the
    # update takes), so that it does happen is asserted only where it cannot depend on load: the
    # vLLM server test and the simulated benchmark.
    synced = [after > before for before, after in zip(handed.versions, handed.versions[1:])]
    assert any(synced[:-1]), f"tiny_qwen3 never trained before the last step: {handed.versions}"
    for step, _, metrics in handed.steps:
        assert 0.0 <= metrics["tiny_qwen3/staleness_mean"] <= 1.0
        if metrics["tiny_qwen3/stale_share"] > 0.0:
            assert step > 0 and synced[step - 1], (step, synced)
    trees = load_trees(tmp_path / "trees" / "step_000002_rank0.jsonl")
    versions = {n.completion.weights_version for t in trees for n in t.answers()}
    assert None not in versions and len(versions) >= 1
    # The sampler's own log-probs fed truncated importance sampling: the mismatch is logged.
    assert "tiny_qwen3/sampler_kl" in trainer.callback_metrics


@pytest.mark.slow
def test_resume_with_a_rollout_in_flight_loses_and_repeats_no_prompt(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    first = tmp_path / "first"
    _, _, whole = _off_policy_run(first, tiny_models_dir, "steps=3",
                                  "callbacks.checkpoint.every_n_train_steps=1")  # fmt: skip
    # Written after step 0, while step 1's rollout was in flight.
    checkpoint = first / "checkpoints" / "step_000001.ckpt"
    assert checkpoint.exists()
    second = tmp_path / "second"
    _, _, resumed = _off_policy_run(second, tiny_models_dir, "steps=3",
                                    "callbacks.checkpoint.every_n_train_steps=1",
                                    f"ckpt_path={checkpoint}")  # fmt: skip
    assert [step for step, _, _ in resumed.steps] == [1, 2]
    trained = [problems for _, problems, _ in whole.steps[:1] + resumed.steps]
    assert trained == [problems for _, problems, _ in whole.steps]


def test_training_span_overlaps_the_next_rollout_with_the_update() -> None:
    from mars2.search.simulation.latency import training_span

    rollouts, updates = [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]
    assert training_span(rollouts, updates, 0.5, 0) == 6.0 + 3.0 + 1.5  # all in turn
    # Rollout 0 (2 s) alone; then each update hides under the next rollout, which the sync
    # after that update pauses (0.5 s): steps 1 and 2 take 2.5 s each, the last update 1.5 s.
    assert training_span(rollouts, updates, 0.5, 1) == 2.0 + 2.5 + 2.5 + 1.5
    # A rollout that ends before the update does is never paused: the trainer is the bottleneck.
    assert training_span([1.0, 1.0], [3.0, 3.0], 0.5, 1) == 1.0 + 3.5 + 3.5
    with pytest.raises(ValueError):
        training_span(rollouts, updates, 0.5, 2)


def test_settle_waits_for_the_rollout_in_flight_and_keeps_its_batch() -> None:
    import threading

    datamodule = TreeSearchDataModule(_engine(), max_staleness=1)
    gate = threading.Event()
    datamodule._rollout = lambda step: (gate.wait(10), ("data", {"step": step}))[1]  # type: ignore[method-assign]
    datamodule._start(3)
    assert datamodule._flying is not None and not datamodule._flying[1].done()
    threading.Timer(0.2, gate.set).start()
    datamodule.settle()  # e.g. held-out evaluation: nothing may be in flight while it runs
    assert datamodule._flying is not None and datamodule._flying[0] == 3
    assert datamodule._flying[1].result() == ("data", {"step": 3})  # still there for the trainer
    datamodule.teardown("fit")
    assert datamodule._flying is None


def test_config_check_refuses_in_process_vllm_with_in_flight_updates() -> None:
    from omegaconf import OmegaConf

    from mars2.utils.validation import ConfigError, check_in_flight_updates

    def cfg(backend: str, staleness: int) -> Any:
        return OmegaConf.create({"max_staleness": staleness,
                                 "search": {"config": {"driver": "pipelined"}},
                                 "agents": {"a": {"generation": {"backend": backend}}}})  # fmt: skip

    with pytest.raises(
        ConfigError, match=r"agent 'a': max_staleness=1 with generation\.backend=vllm:"
    ):
        check_in_flight_updates(cfg("vllm", 1))
    for backend in ("vllm_server", "transformers"):
        check_in_flight_updates(cfg(backend, 1))
    check_in_flight_updates(cfg("vllm", 0))

"""Fault injection for the training loop (issue #42): each fault N times, at points chosen by a
seeded RNG, then the outcome compared with a fault-free run. Writes the table of
docs/reliability.md (fault, trials, survived, samples lost, samples duplicated, exact, recovery).

    python benchmarks/chaos.py [--quick] [--trials N] [--trainer-trials N] [--out FILE]

`--quick` is the CI subset (tests/test_chaos.py): the cheap in-process faults, few trials, no
real training run. The full run (`make chaos`) adds kill -9 and SIGTERM of a real tiny run
(`experiment=tiny_pair`, CPU), resumed and compared with an uninterrupted run of the same seed.
E2B is a local fake of its SDK (tests/fakes/e2b_sdk.py): the remote service cannot be reached
from this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.fakes (the E2B SDK fake)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SLOW_ADD = "import time\ntime.sleep(0.3)\n" + ADD
TESTS = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "4"}]


@dataclass
class Trial:
    survived: bool
    lost: int = 0  # samples (answers, metric points, steps) gone for good
    duplicated: int = 0
    exact: bool | None = None  # bit-equal with the fault-free run (None: not applicable)
    recover_s: float = 0.0
    note: str = ""


@dataclass
class Fault:
    name: str
    what: str
    run: Callable[[random.Random, Path], Trial]
    cheap: bool = True
    skip: str = ""
    max_trials: int | None = (
        None  # a cap where one trial is slow (sqlite's busy timeouts)  # why it cannot be tried here
    )
    trials: list[Trial] = field(default_factory=list)


# --- the sandbox -------------------------------------------------------------------------------


def worker_killed(rng: random.Random, tmp: Path) -> Trial:
    """kill -9 of a local sandbox worker at a random moment of a batch of correct answers: each
    answer is regraded (passed) or an infrastructure error, never a wrong answer; the pool keeps
    serving."""
    from mars2.sandbox.base import Job, Verdict
    from mars2.sandbox.pool.local import LocalSandbox

    with LocalSandbox(num_workers=2, per_test_timeout=2.0, job_timeout=10.0) as box:
        box.run_batch([Job(ADD, "stdin", TESTS)] * 2)  # workers started
        delay = rng.uniform(0.0, 0.8)

        def kill() -> None:
            time.sleep(delay)
            handle = box._workers[rng.randrange(2)]
            if handle is not None:
                handle.kill()

        killer = threading.Thread(target=kill)
        killer.start()
        began = time.monotonic()
        results = box.run_batch([Job(SLOW_ADD, "stdin", TESTS)] * 6)
        killer.join()
        wrong = sum(not r.all_passed and not r.infra_error for r in results)
        infra = sum(r.infra_error for r in results)
        after = box.run_batch([Job(ADD, "stdin", TESTS)] * 2)
        serving = all(r.all_passed for r in after)
        recover = time.monotonic() - began
    assert Verdict.INFRA_ERROR  # the verdict the lost answers carry
    return Trial(
        survived=wrong == 0 and serving, lost=infra, exact=wrong == 0 and infra == 0,
        recover_s=recover, note=f"kill at {delay:.2f}s: {infra} infra_error, {wrong} wrong",
    )  # fmt: skip


SIGNAL_IGNORING_TREE = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
for _ in range({children}):
    if os.fork() == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.1)
time.sleep(60)
"""


def signal_ignoring_tree(rng: random.Random, tmp: Path) -> Trial:
    """An answer whose process tree ignores SIGTERM/SIGINT (and leaves its session): graded as
    not passed within its timeout, nothing survives it, the next answer passes."""
    from mars2.sandbox.base import Job
    from mars2.sandbox.pool.local import POOL_MARGIN, LocalSandbox
    from mars2.sandbox.runner.limits import count_tasks_of

    children = rng.randint(1, 4)
    job_timeout = 2.0
    with LocalSandbox(num_workers=1, per_test_timeout=1.0, job_timeout=job_timeout) as box:
        began = time.monotonic()
        code = SIGNAL_IGNORING_TREE.format(children=children)
        (result,) = box.run_batch([Job(code, "stdin", TESTS[:1])])
        elapsed = time.monotonic() - began
        uid = box.isolation["sandbox_uid"]
        left = count_tasks_of(uid) if uid is not None else 0
        (after,) = box.run_batch([Job(ADD, "stdin", TESTS)])
    bounded = elapsed < job_timeout + POOL_MARGIN
    survived = not result.all_passed and left == 0 and after.all_passed and bounded
    return Trial(
        survived=survived, exact=survived, recover_s=elapsed,
        note=f"{children} children: {result.tests[0].verdict.value}, {left} left",
    )  # fmt: skip


def e2b_faults(rng: random.Random, tmp: Path) -> Trial:
    """The E2B pool against a fake SDK (the remote service cannot be reached from here) that
    answers 429, 5xx, timeouts and slow creations at random: same verdicts as a fault-free run,
    the concurrency cap and creation rate honoured, retries counted."""
    from tests.fakes import e2b_sdk

    from mars2.sandbox.base import Job
    from mars2.sandbox.pool.e2b import E2BSandbox

    jobs = [Job(ADD, "stdin", TESTS), Job("print(3)", "stdin", TESTS)] * 4

    def run(faulty: bool) -> tuple[list[Any], int, Any]:
        e2b_sdk.STATE = e2b_sdk.FakeState()
        if faulty:
            share = rng.uniform(0.1, 0.4)
            plan_rng = random.Random(rng.random())

            def plan() -> str | None:
                if plan_rng.random() < share:
                    return plan_rng.choice(["429", "5xx", "timeout", "slow"])
                return None

            e2b_sdk.STATE.create_fault = plan
            e2b_sdk.STATE.command_fault = plan
            e2b_sdk.STATE.slow_seconds = 0.2
        with E2BSandbox(
            api_key="k", max_concurrency=3, retries=8, backoff=0.02, max_creates_per_second=20.0,
            seed=rng.randrange(1 << 30), sdk=e2b_sdk,
        ) as box:  # fmt: skip
            results = box.run_batch(jobs)
            retried = box.retried
        return [[t.verdict for t in r.tests] for r in results], retried, e2b_sdk.STATE

    clean, _, _ = run(False)
    began = time.monotonic()
    got, retried, state = run(True)
    elapsed = time.monotonic() - began
    # Requests as they arrived: the create times the fake records after an injected slow create
    # or timeout are not when the request was sent, and two of them could sit closer than 1/rate.
    times = sorted(state.request_times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    rate_ok = all(gap >= 1 / 20.0 - 0.01 for gap in gaps)
    survived = got == clean and state.peak <= 3 and rate_ok
    note = f"{retried} retried, {state.created} created, peak {state.peak}"
    differ = [f"job {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(clean, got)) if a != b]
    if differ:  # which verdicts moved, so a miss can be read off the table
        note += "; " + "; ".join(differ)
    if not rate_ok:
        note += f"; creates {min(gaps):.3f} s apart"
    return Trial(survived=survived, exact=got == clean, recover_s=elapsed, note=note)


# --- data ---------------------------------------------------------------------------------------

BAD_LINES = {
    "missing tests": json.dumps({"prompt": "x", "label": {"inputs": [], "outputs": []}}).encode(),
    "bad JSON": b'{"prompt": "x", "label": ',
    "non-UTF-8 byte": b'{"prompt": "caf\xe9", "label": {"inputs": ["1"], "outputs": ["1"]}}',
}


def dataset_row(rng: random.Random, tmp: Path) -> Trial:
    """One malformed row (of a random kind, at a random line) among 20 good ones: the loader
    names the file and line; with bad_rows=skip it keeps the 20 and counts the one."""
    from mars2.data.loaders import load_deepcoder
    from mars2.data.problem import ProblemFormatError

    kind = rng.choice(list(BAD_LINES))
    at = rng.randrange(21)
    good = [
        json.dumps({"id": f"p{i}", "prompt": "echo", "label": {"inputs": ["1"], "outputs": ["1"]}})
        .encode()
        for i in range(20)
    ]  # fmt: skip
    lines = [*good[:at], BAD_LINES[kind], *good[at:]]
    path = tmp / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    began = time.monotonic()
    try:
        load_deepcoder(path)
        named = False
    except ProblemFormatError as error:
        named = f"{path}:{at + 1}:" in str(error) and "bad_rows=skip" in str(error)
    kept = load_deepcoder(path, bad_rows="skip")
    return Trial(
        survived=named and len(kept) == 20, lost=20 - len(kept), exact=named and len(kept) == 20,
        recover_s=time.monotonic() - began, note=f"{kind} at line {at + 1}",
    )  # fmt: skip


# --- checkpoints and the tracking store --------------------------------------------------------


def _mounted_tmpfs(folder: Path, kilobytes: int) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kilobytes}k", "tmpfs", str(folder)],
        capture_output=True,
    )
    return done.returncode == 0


def disk_full_skip() -> str:
    if os.geteuid() != 0:
        return "needs root to mount a size-limited tmpfs"
    probe = Path(tempfile.mkdtemp(prefix="chaos-probe-"))
    try:
        if not _mounted_tmpfs(probe, 64):
            return "mount -t tmpfs refused here (a container without CAP_SYS_ADMIN?)"
        subprocess.run(["umount", str(probe)], check=False)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return ""


def disk_full(rng: random.Random, tmp: Path) -> Trial:
    """Checkpoints (every step) into a size-limited tmpfs that fills at a random step: the run
    stops with a one-paragraph WriteError and last.ckpt is the previous, complete checkpoint."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from mars2.training.checkpoint import AtomicModelCheckpoint
    from mars2.utils.atomic import WriteError

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(64, 64), batch_size=4)

    folder = tmp / "checkpoints"
    size_kb = rng.randint(160, 900)  # one checkpoint is ~70 kB (+ its temporary copy)
    if not _mounted_tmpfs(folder, size_kb):
        return Trial(survived=False, note="mount failed")
    try:
        checkpoint = AtomicModelCheckpoint(
            dirpath=folder, filename="step_{step:06d}", every_n_train_steps=1, save_last=True,
            save_top_k=-1, auto_insert_metric_name=False,
        )  # fmt: skip
        trainer = pl.Trainer(
            max_steps=16, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu", default_root_dir=tmp,
        )  # fmt: skip
        began = time.monotonic()
        message = ""
        try:
            trainer.fit(Linear())
        except WriteError as error:
            message = str(error)
        elapsed = time.monotonic() - began
        last = folder / "last.ckpt"
        loadable, step = False, -1
        if last.exists():
            try:
                step = int(torch.load(last, weights_only=False)["global_step"])
                loadable = True
            except Exception:
                loadable = False
        paragraph = bool(message) and "\n" not in message.strip() and "full" in message
        torn = [p.name for p in folder.iterdir() if p.name.startswith(".")]
        finished = not message and step == 16
        survived = (paragraph and loadable and not torn) or finished
        return Trial(
            survived=survived, exact=None, recover_s=elapsed,
            note=f"{size_kb} kB: stopped at step {trainer.global_step}, last.ckpt step {step}"
            + ("" if message else " (no fault: disk large enough)"),
        )  # fmt: skip
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def disk_full_trees(rng: random.Random, tmp: Path) -> Trial:
    """Search trees written step after step (as the callback does) into a size-limited tmpfs that
    fills at a random step: the write stops with a one-paragraph WriteError, every tree file
    written before it loads, and no torn or temporary file is left."""
    from mars2.data.toy import toy_problems
    from mars2.search.tree import SearchTree, load_trees, save_trees
    from mars2.utils.atomic import WriteError

    folder = tmp / "trees"
    size_kb = rng.randint(64, 400)
    if not _mounted_tmpfs(folder, size_kb):
        return Trial(survived=False, note="mount failed")
    try:
        trees = []
        for problem in toy_problems()[:4]:  # ~10 kB a step: a few long answers per tree
            tree = SearchTree.new(problem)
            for node in range(3):
                prompt = [{"role": "user", "content": "y" * 800 + str(node)}]
                tree.add(tree.root.id, agent="a", messages=prompt, reward=0.5)
            trees.append(tree)
        began = time.monotonic()
        message, written = "", []
        for step in range(1, 200):
            path = folder / f"step_{step:06d}_rank0.jsonl"
            try:
                save_trees(trees, path)
            except WriteError as error:
                message = str(error)
                break
            written.append(path)
        elapsed = time.monotonic() - began
        loadable = all(len(load_trees(p)) == len(trees) for p in written)
        torn = [p.name for p in folder.iterdir() if p.name.startswith(".")]
        paragraph = bool(message) and "\n" not in message.strip() and "full" in message
        return Trial(
            survived=paragraph and loadable and not torn, exact=None, recover_s=elapsed,
            note=f"{size_kb} kB: stopped at step {len(written) + 1}, {len(written)} files load",
        )  # fmt: skip
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def mlflow_refused(rng: random.Random, tmp: Path) -> Trial:
    """A `logger.tracking_uri` server that refuses connections, given plainly, with
    hydra.run.dir, or under -m (chosen at random): refused before any folder or model, in one
    paragraph naming the fix, within seconds (MLflow's own client retries for minutes)."""
    import socket

    from mars2.cli.errors import user_errors
    from mars2.cli.preflight import preflight
    from mars2.utils.runs import register_resolver

    register_resolver()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    way = rng.choice(["plain", "hydra.run.dir", "-m"])
    argv = ["experiment=tiny_pair", "data=arith", f"paths.log_dir={tmp / 'logs'}",
            f"logger.tracking_uri=http://127.0.0.1:{port}"]  # fmt: skip
    if way == "hydra.run.dir":
        argv.append(f"hydra.run.dir={tmp / 'run'}")
    if way == "-m":
        argv = ["-m", *argv, "seed=1,2"]
    began = time.monotonic()
    try:
        preflight("train", argv)
        message = ""
    except user_errors() as error:
        message = str(error)
    elapsed = time.monotonic() - began
    paragraph = "does not answer" in message and "\n" not in message.strip()
    no_folder = not (tmp / "run").exists() and not (tmp / "logs").exists()
    return Trial(
        survived=paragraph and no_folder, exact=None, recover_s=elapsed,
        note=f"{way}: refused in {elapsed:.1f}s" if paragraph else f"{way}: not refused",
    )  # fmt: skip


def mlflow_locked(rng: random.Random, tmp: Path) -> Trial:
    """The sqlite tracking store locked by another writer during random steps of 12: the run goes
    on, keeps those metrics in the run folder and sends them when the lock is gone; every step
    ends up in MLflow once."""
    import logging

    from mlflow.tracking import MlflowClient

    from mars2.utils.tracking import RunTracker

    for name in ("mars2.utils.tracking", "mlflow", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    db = tmp / "mlflow.db"
    uri = f"sqlite:///{db}"
    run_dir = tmp / "run"
    run_dir.mkdir()
    tracker = RunTracker(experiment_name="chaos", tracking_uri=uri, run_dir=str(run_dir))
    tracker.log_metrics({"warm": 0.0}, step=0)  # creates the tables and the run
    first = rng.randrange(1, 10)
    locked = set(range(first, first + rng.randint(1, 3)))
    began = time.monotonic()
    held: sqlite3.Connection | None = None
    for step in range(1, 13):
        if step in locked and held is None:
            held = sqlite3.connect(db, timeout=0.1, isolation_level=None)
            held.execute("BEGIN EXCLUSIVE")
        if step not in locked and held is not None:
            held.execute("ROLLBACK")
            held.close()
            held = None
        tracker.log_metrics({"reward": float(step)}, step=step)
    if held is not None:
        held.execute("ROLLBACK")
        held.close()
    tracker.finalize("success")
    elapsed = time.monotonic() - began
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "reward")
    steps = sorted(int(p.step) for p in history)
    lost = len(set(range(1, 13)) - set(steps))
    duplicated = len(steps) - len(set(steps))
    kept = (run_dir / RunTracker.PENDING).exists()
    return Trial(
        survived=lost == 0 and duplicated == 0 and not kept, lost=lost, duplicated=duplicated,
        exact=lost == 0 and duplicated == 0, recover_s=elapsed,
        note=f"locked during steps {sorted(locked)}",
    )  # fmt: skip


# --- the trainer (a real tiny run) -------------------------------------------------------------

TINY = os.environ.get("MARS2_TINY_MODELS", str(REPO / ".cache" / "tiny_models"))
STEPS = 6
PAIR: dict[str, str] = {}  # the warm-started pair the trials train (built once, or --pair)


def _train_command(logs: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "src/mars2/train.py"), "experiment=tiny_pair", "debug=fast",
        f"steps={STEPS}", "data=arith", f"paths.log_dir={logs}",
        f"paths.tiny_models_dir={PAIR.get('models', TINY)}", "sandbox.num_workers=1",
        "advantage.filter_degenerate=false", "problems_per_step=1", "search.config.max_nodes=2",
        *extra,
    ]  # fmt: skip


def warm_pair(tmp_root: Path) -> str:
    """The tiny pair warm-started once (experiment=tiny_pair's 45 epochs on data.warm_start), as
    a models folder for the trials: the untrained pair never solves a problem, so every reward is
    0, no update moves a weight and "equal weights" would say nothing. With this pair the trials'
    agents solve some problems and train."""
    if "models" not in PAIR:
        logs = tmp_root / "warm_pair"
        subprocess.run(
            [*_train_command(logs, "steps=1"),
             "+warm_start={epochs: 45, lr: 2.0e-3, batch_size: 16, target_loss: null}"],
            cwd=tmp_root, env=_env(), capture_output=True, check=True, timeout=1800,
        )  # fmt: skip
        (folder,) = (logs / "train" / "runs" / "tiny_pair").iterdir()
        PAIR["models"] = str(folder / "agents")
    return PAIR["models"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(REPO / "src")}  # fmt: skip


def _outcome(logs: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Any]]:
    """Every metric's (step, value) history and the last checkpoint's weights."""
    import torch
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{logs}/mlflow/mlflow.db")
    experiment = client.get_experiment_by_name("mars2-train")
    (run,) = client.search_runs([experiment.experiment_id])
    history = {}
    for key in run.data.metrics:
        if "seconds" in key or "per_s" in key or "time" in key or "busy" in key:
            continue  # wall-clock figures (and busy fractions of them) differ between any two runs
        history[key] = sorted(
            (int(p.step), float(p.value)) for p in client.get_metric_history(run.info.run_id, key)
        )
    (folder,) = (logs / "train" / "runs" / "tiny_pair").iterdir()
    state = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    return history, state


_REFERENCE: dict[str, Any] = {}


def _reference(tmp_root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    warm_pair(tmp_root)
    if not _REFERENCE:
        logs = tmp_root / "reference"
        subprocess.run(
            _train_command(logs), cwd=tmp_root, env=_env(), capture_output=True, check=True,
            timeout=900,
        )  # fmt: skip
        _REFERENCE["history"], _REFERENCE["state"] = _outcome(logs)
        print(f"reference run: {what_it_trained(_REFERENCE['history'])}", flush=True)
    return _REFERENCE["history"], _REFERENCE["state"]


def what_it_trained(history: dict[str, list[tuple[int, float]]]) -> str:
    """Which steps moved weights, and where an agent that had trained sat a step out (where a
    resumed run used to log differently); refuses a reference that never trained."""
    moved = sorted({s for k, points in history.items() if k.endswith("/grad_norm")
                    for s, v in points if v > 0})  # fmt: skip
    if not moved:
        raise RuntimeError(
            "the reference run never moved a weight (every reward equal): equal weights after a "
            "resume would say nothing. Pass a pair that solves some problems with --pair."
        )
    idle = []
    for key, points in history.items():
        if key.endswith("/stepped"):
            done = [s for s, v in points if v]
            idle += [
                f"{key.split('/')[0]}@{s}" for s, v in points if not v and done and s > done[0]
            ]
    return f"weights moved at steps {moved}; idle after training: {sorted(idle) or 'none'}"


def _compare(
    logs: Path, reference: tuple[dict[str, Any], dict[str, Any]]
) -> tuple[int, int, bool, str]:
    """(steps lost, steps duplicated, bit-equal, the first difference or "")."""
    import torch

    history, state = _outcome(logs)
    ref_history, ref_state = reference
    steps = [s for s, _ in history.get("reward", [])]
    lost = len(set(range(1, STEPS + 1)) - set(steps))  # logged steps count from 1
    duplicated = len(steps) - len(set(steps))
    differ = [k for k in state if k not in ref_state or not torch.equal(state[k], ref_state[k])]
    differ += [k for k in ref_state if k not in state]
    firsts = []  # (step, key, this run's value, the reference's)
    for key in sorted(set(history) | set(ref_history)):
        mine, theirs = dict(history.get(key, [])), dict(ref_history.get(key, []))
        at = [s for s in sorted(set(mine) | set(theirs)) if mine.get(s) != theirs.get(s)]
        if at:
            firsts.append((at[0], key, mine.get(at[0]), theirs.get(at[0])))
    first = ""
    if firsts:
        step, key, mine_value, their_value = min(firsts, key=lambda item: (item[0], item[1]))
        first = f"{key} at step {step}: {mine_value} vs {their_value}"
    elif differ:
        first = f"weights {differ[0]}"
    return lost, duplicated, not differ and history == ref_history, first


def _interrupted(rng: random.Random, tmp: Path, signum: int) -> Trial:
    reference = _reference(tmp.parent)
    logs = tmp / "logs"
    first = subprocess.Popen(
        _train_command(logs), cwd=tmp, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    runs_root = logs / "train" / "runs" / "tiny_pair"
    # A random point of a random step: after a random number of checkpoints, a random delay.
    after = rng.randrange(0, STEPS - 2)
    delay = rng.uniform(0.0, 0.5)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and first.poll() is None:
        if len(list(runs_root.glob("*/checkpoints/step_*.ckpt"))) > after:
            break
        time.sleep(0.05)
    time.sleep(delay)
    if first.poll() is not None:
        return Trial(survived=True, note="finished before the signal (not counted as a fault)")
    sent = time.monotonic()
    if signum == signal.SIGKILL:
        os.killpg(first.pid, signal.SIGKILL)
    else:
        os.kill(first.pid, signal.SIGTERM)  # what SLURM sends to the job step
    try:
        out, _ = first.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(first.pid, signal.SIGKILL)
        out, _ = first.communicate()
        return Trial(survived=False, note="SIGTERM: still running after 120 s")
    stopped = time.monotonic() - sent
    console = out.decode(errors="replace")
    note = f"after checkpoint {after + 1} + {delay:.2f}s"
    if signum == signal.SIGTERM:
        clear = first.returncode == 128 + signal.SIGTERM and "resume=true" in console
        note += f": exit {first.returncode} in {stopped:.1f}s"
        if not clear:
            return Trial(survived=False, note=note + " (no requeue message / wrong exit code)")
    try:
        os.killpg(first.pid, signal.SIGKILL)  # what the process group left (sandbox workers)
    except ProcessLookupError:
        pass
    began = time.monotonic()
    second = subprocess.run(
        _train_command(logs, "resume=true"), cwd=tmp, env=_env(), capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    recover = time.monotonic() - began
    if second.returncode != 0:
        return Trial(survived=False, recover_s=recover, note=note + ": resume failed")
    lost, duplicated, exact, first = _compare(logs, reference)
    return Trial(
        survived=lost == 0 and duplicated == 0, lost=lost, duplicated=duplicated, exact=exact,
        recover_s=recover, note=note + (f"; differs: {first}" if first else ""),
    )  # fmt: skip


def trainer_kill9(rng: random.Random, tmp: Path) -> Trial:
    """kill -9 of the whole run at a random point of a random step, then resume=true."""
    return _interrupted(rng, tmp, signal.SIGKILL)


def trainer_sigterm(rng: random.Random, tmp: Path) -> Trial:
    """SIGTERM (SLURM's preemption notice): checkpoint at a step boundary, exit 143 with how to
    requeue, then resume=true."""
    return _interrupted(rng, tmp, signal.SIGTERM)


# --- the table --------------------------------------------------------------------------------


def faults() -> list[Fault]:
    skip_disk = disk_full_skip()
    skip_trainer = "" if Path(TINY).exists() else f"no tiny models at {TINY} (make models)"
    return [
        Fault("sandbox worker kill -9 mid-batch", "regraded or infra_error", worker_killed),
        Fault("answer's process tree ignores signals", "not passed, reaped", signal_ignoring_tree),
        Fault("E2B 429/5xx/timeouts/slow creates (fake SDK)", "same verdicts", e2b_faults),
        Fault("malformed dataset row", "file:row named; skip counts", dataset_row),
        Fault(
            "disk full during checkpoint write (tmpfs)",
            "previous ckpt loadable",
            disk_full,
            skip=skip_disk,
        ),
        Fault(
            "disk full during a tree write (tmpfs)",
            "earlier trees load, one paragraph",
            disk_full_trees,
            skip=skip_disk,
        ),
        Fault("MLflow sqlite store locked", "kept locally, synced", mlflow_locked, max_trials=3),
        Fault("MLflow server refuses connections", "refused before the run", mlflow_refused),
        Fault(
            "trainer kill -9 at a random point",
            "resume",
            trainer_kill9,
            cheap=False,
            skip=skip_trainer,
        ),
        Fault(
            "trainer SIGTERM (preemption)",
            "ckpt, exit 143, resume",
            trainer_sigterm,
            cheap=False,
            skip=skip_trainer,
        ),
    ]


def run_all(
    trials: int, trainer_trials: int, seed: int, quick: bool, only: list[str] | None = None
) -> list[Fault]:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="mars2-chaos-"))
    chosen = [
        f for f in faults() if (f.cheap or not quick) and (not only or f.run.__name__ in only)
    ]
    try:
        for fault in chosen:
            if fault.skip:
                print(f"{fault.name}: skipped ({fault.skip})", flush=True)
                continue
            count = trials if fault.cheap else trainer_trials
            count = min(count, fault.max_trials or count)
            for index in range(count):
                tmp = root / f"{fault.run.__name__}_{index}"
                tmp.mkdir()
                try:
                    trial = fault.run(rng, tmp)
                except Exception as error:  # a fault the harness did not survive either
                    trial = Trial(survived=False, note=f"{type(error).__name__}: {error}"[:200])
                fault.trials.append(trial)
                print(f"{fault.name} #{index}: {trial}", flush=True)
                if not fault.cheap:
                    shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return chosen


def table(chosen: list[Fault]) -> str:
    lines = [
        "| fault | expected | trials | survived | samples lost | samples duplicated | exact | "
        "time to recover (median s) | example |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fault in chosen:
        if fault.skip:
            lines.append(f"| {fault.name} | {fault.what} | skipped: {fault.skip} | | | | | | |")
            continue
        ts = fault.trials
        exact = [t.exact for t in ts if t.exact is not None]
        exact_text = "n/a" if not exact else ("yes" if all(exact) else f"{sum(exact)}/{len(exact)}")
        recover = sorted(t.recover_s for t in ts)
        median = recover[len(recover) // 2] if recover else 0.0
        example = next(
            (t.note for t in ts if not t.survived),
            next((t.note for t in ts if t.exact is False), ts[0].note if ts else ""),
        )
        lines.append(
            f"| {fault.name} | {fault.what} | {len(ts)} | {sum(t.survived for t in ts)} | "
            f"{sum(t.lost for t in ts)} | {sum(t.duplicated for t in ts)} | {exact_text} | "
            f"{median:.1f} | {example.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI subset: cheap faults only")
    parser.add_argument("--trials", type=int, default=10, help="trials of each cheap fault")
    parser.add_argument("--trainer-trials", type=int, default=3, help="trials of each run fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the table into this markdown file")
    parser.add_argument("--json", action="store_true", help="print the trials as JSON")
    names = [f.run.__name__ for f in faults()]
    parser.add_argument(
        "--only", type=lambda text: text.split(","), metavar="NAME[,NAME]",
        help=f"run only these faults ({', '.join(names)}); --out then replaces only their rows",
    )  # fmt: skip
    parser.add_argument(
        "--pair", metavar="DIR", help="a warm-started tiny pair to reuse (a run's agents/ folder); "
        "by default the training-run faults warm one up first (about 4 CPU-minutes)",
    )  # fmt: skip
    args = parser.parse_args()
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"--only: no fault named {', '.join(unknown)} (the names: {', '.join(names)})")
    if args.pair:
        PAIR["models"] = str(Path(args.pair).resolve())
    began = time.monotonic()
    chosen = run_all(args.trials, args.trainer_trials, args.seed, args.quick, args.only)
    text = table(chosen)
    print(text)
    print(f"chaos: {time.monotonic() - began:.0f} s", flush=True)
    if args.json:
        print(json.dumps({f.name: [t.__dict__ for t in f.trials] for f in chosen}))
    if args.out:
        write_table(args.out, text, time.monotonic() - began, args)
    failed = [f.name for f in chosen if not f.skip and not all(t.survived for t in f.trials)]
    if failed:
        print(f"chaos: not survived: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


BEGIN, END = "<!-- chaos table: begin -->", "<!-- chaos table: end -->"


def write_table(path: Path, text: str, seconds: float, args: argparse.Namespace) -> None:
    old = (
        path.read_text(encoding="utf-8") if path.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    )
    head, _, rest = old.partition(BEGIN)
    body, _, tail = rest.partition(END)
    if args.only:  # replace the rerun faults' rows (add new ones), keep the others and captions
        lines = body.strip().splitlines()
        same = (
            f"_Rows of {', '.join(args.only)} rerun alone"  # a rerun of the same rows: its caption
        )
        captions = [line for line in lines if line.startswith("_") and not line.startswith(same)]
        captions.append(
            f"{same} (`--only`, seed {args.seed}, --trials {args.trials}, "
            f"--trainer-trials {args.trainer_trials}, {seconds:.0f} s)._"
        )
        table_lines = [line for line in text.splitlines() if line.startswith("|")]
        header, fresh = table_lines[:2], table_lines[2:]
        rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
        rows.pop(header[0].split(" | ")[0], None)
        rows.update({line.split(" | ")[0]: line for line in fresh})
        order = [f"| {fault.name}" for fault in faults()]
        ordered = sorted(rows, key=lambda key: order.index(key) if key in order else len(order))
        block = (
            f"{BEGIN}\n" + "\n".join(captions) + "\n\n" + "\n".join(header)
            + "\n" + "\n".join(rows[key] for key in ordered) + f"\n{END}"
        )  # fmt: skip
    else:
        block = (
            f"{BEGIN}\n_Written by `make chaos` (seed {args.seed}, {args.trials} trials of each "
            f"cheap fault, {args.trainer_trials} of each training-run fault, {seconds:.0f} s)._\n\n"
            f"{text}{END}"
        )
    path.write_text(head + block + tail, encoding="utf-8")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()

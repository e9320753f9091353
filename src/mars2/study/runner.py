"""Run a study: every job for every seed, ``jobs`` at a time, cached, resumable, failure-tolerant.

Jobs per seed: each agent's warm start; each training run (an arm, or an arm per agent); test
sampling of every warm start (twice: the A/A stream) and every trained agent; every evaluation
tree. A job runs once its inputs exist. A finished job is kept under ``<work>/cache/<id>.json``
with its key (the job, the study's task and settings, the code's version) and reused by a later
run with the same key: a run stopped by Ctrl-C resumes where it stopped. A failed job is recorded
with its error, and the jobs that need its output are recorded as failed with the reason; the
others go on.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import subprocess
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars2.study.spec import Study

REPO = Path(__file__).resolve().parents[3]
KIND_ORDER = {"warm": 0, "train": 1, "tree": 2, "sample": 3}


def code_version() -> str:
    """A hash of the committed trees of src and configs plus uncommitted changes to them; outside
    a git checkout a unique value (nothing is reused)."""
    code = ("src", "configs")
    try:
        trees = subprocess.run(["git", "rev-parse", *(f"HEAD:{d}" for d in code)], cwd=REPO,
                               capture_output=True, check=True).stdout  # fmt: skip
        diff = subprocess.run(["git", "diff", "HEAD", "--", *code], cwd=REPO,
                              capture_output=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return f"unknown-{time.time()}"
    return hashlib.sha256(trees + diff).hexdigest()[:16]


@dataclass
class Job:
    id: str
    kind: str
    seed: int
    spec: dict[str, Any]
    needs: list[str] = field(default_factory=list)


def plan(study: Study, seeds: list[int]) -> list[Job]:
    """Every job of the study for these seeds, in a fixed order."""
    jobs: list[Job] = []
    for seed in seeds:
        for agent in study.agents:
            jobs.append(Job(f"warm/{agent}/seed{seed}", "warm", seed, {"agent": agent}))
        for run in study.training_runs():
            label = "+".join(run["members"])
            needs = [f"warm/{m}/seed{seed}" for m in run["members"]]
            jobs.append(Job(f"train/{run['arm']}/{label}/seed{seed}", "train", seed, run, needs))
        sources = sorted(study.sources())
        for source in sources:
            jobs.append(Job(f"sample/{source}/seed{seed}", "sample", seed,
                            {"source": source, "stream": "test"}, [_producer(study, source, seed)]))  # fmt: skip
        for agent in study.agents:  # A/A: identical weights, a second sample stream
            jobs.append(Job(f"sample/aa/{agent}/seed{seed}", "sample", seed,
                            {"source": f"warm/{agent}", "stream": "test-aa"},
                            [f"warm/{agent}/seed{seed}"]))  # fmt: skip
        for evaluation in study.evaluations():
            needs = sorted({_producer(study, s, seed) for s in evaluation["agents"]})
            jobs.append(Job(f"tree/{evaluation['name']}/seed{seed}", "tree", seed,
                            {"name": evaluation["name"], "agents": list(evaluation["agents"])},
                            needs))  # fmt: skip
    return jobs


def _producer(study: Study, source: str, seed: int) -> str:
    arm, agent = source.split("/", 1)
    if arm == "warm":
        return f"warm/{agent}/seed{seed}"
    for run in study.training_runs():
        if run["arm"] == arm and agent in run["members"]:
            return f"train/{arm}/{'+'.join(run['members'])}/seed{seed}"
    raise KeyError(source)


def job_key(study: Study, job: Job, code: str) -> str:
    material = {"job": job.spec, "id": job.id, "task": study.task, "settings": study.settings,
                "code": code}  # fmt: skip
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def _weights(source: str, seed: int, done: dict[str, dict[str, Any]], study: Study) -> str:
    arm, agent = source.split("/", 1)
    record = done[_producer(study, source, seed)]["result"]
    return str(record["weights"]) if arm == "warm" else str(record["weights"][agent])


def execute(module: str, kind: str, args: tuple[Any, ...]) -> dict[str, Any]:
    """In a worker: run one job (``<module>.<kind>_job``); never raises (the error is the
    record)."""
    import importlib

    began = time.perf_counter()
    try:
        result = getattr(importlib.import_module(module), f"{kind}_job")(*args)
        return {"result": result, "error": None, "job_wall_seconds": time.perf_counter() - began}
    except BaseException as error:  # a failed run is data, not a crash
        if isinstance(error, KeyboardInterrupt):
            raise
        return {"result": None, "error": "".join(traceback.format_exception(error))[-4000:],
                "job_wall_seconds": time.perf_counter() - began}  # fmt: skip


def _arguments(study: Study, job: Job, done: dict[str, dict[str, Any]],
               work: Path) -> tuple[Any, ...]:  # fmt: skip
    task, s = study.task, study.settings
    folder = str(work / "weights" / job.id)
    if job.kind == "warm":
        return (task, s, job.spec["agent"], job.seed, folder)
    if job.kind == "train":
        warm = {m: done[f"warm/{m}/seed{job.seed}"]["result"]["weights"]
                for m in job.spec["members"]}  # fmt: skip
        return (task, s, job.spec, job.seed, warm, folder)
    if job.kind == "sample":
        source = job.spec["source"]
        path = _weights(source, job.seed, done, study)
        return (task, s, path, source.split("/", 1)[1], job.seed, job.spec["stream"], "test")
    weights = {s.split("/", 1)[1]: _weights(s, job.seed, done, study) for s in job.spec["agents"]}
    if len(weights) != len(job.spec["agents"]):
        raise ValueError(f"evaluation {job.spec['name']}: two weights with one agent name")
    return (task, s, weights, job.seed, f"tree/{job.spec['name']}", "test")


def dump(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)


def run_study(study: Study, seeds: list[int], out: Path, work: Path, jobs: int = 2,
              progress: bool = True, module: str = "mars2.study.jobs",
              collect_only: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Run every job not cached; write ``out/runs.jsonl`` (all records, in plan order).
    ``collect_only``: run nothing, write the finished jobs (whatever code version ran them).

    `module` holds the job functions (``warm_job``, ``train_job``, ``sample_job``, ``tree_job``)
    and the workers' ``worker_init``: tests pass a module of cheap stand-ins."""
    import importlib

    worker_init = importlib.import_module(module).worker_init
    code = code_version()
    planned = plan(study, seeds)
    cache = work / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict[str, Any]] = {}
    for job in planned:
        path = cache / f"{job.id.replace('/', '__')}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            # collect_only takes a finished job of any code version (the one it ran with is in
            # the record); a run reuses only jobs of this code.
            version = str(record.get("code")) if collect_only else code
            if record.get("key") == job_key(study, job, version) and record.get("error") is None:
                done[job.id] = record
    bar = _bar(len(planned), len(done), progress)
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=worker_init)
    running: dict[Future[dict[str, Any]], Job] = {}
    # collect_only: write runs.jsonl from the cache, run nothing (a study stopped early).
    waiting = [] if collect_only else [j for j in planned if j.id not in done]

    def finish(job: Job, outcome: dict[str, Any]) -> None:
        record = {"id": job.id, "kind": job.kind, "seed": job.seed, "spec": job.spec,
                  "key": job_key(study, job, code), "code": code, **outcome}  # fmt: skip
        done[job.id] = record
        path = cache / f"{job.id.replace('/', '__')}.json"
        path.write_text(dump(record))
        bar.update(1)
        if record["error"] is not None:
            bar.write(f"FAILED {job.id}: {record['error'].strip().splitlines()[-1]}")

    try:
        while waiting or running:
            for job in list(waiting):
                failed = [n for n in job.needs if n in done and done[n]["error"] is not None]
                if failed:
                    waiting.remove(job)
                    finish(job, {"result": None, "error": f"not run: needs failed job(s) {failed}",
                                 "job_wall_seconds": 0.0})  # fmt: skip
            ready = [j for j in waiting if all(n in done for n in j.needs)]
            # Seed by seed (a study cut short leaves whole seeds), within one the longest first.
            ready.sort(key=lambda j: (j.seed, KIND_ORDER[j.kind], -len(j.spec.get("members", []))))
            while ready and len(running) < jobs:
                job = ready.pop(0)
                waiting.remove(job)
                try:
                    args = _arguments(study, job, done, work)
                except Exception as error:
                    finish(job, {"result": None, "error": repr(error), "job_wall_seconds": 0.0})
                    continue
                running[pool.submit(execute, module, job.kind, args)] = job
            if not running:
                continue
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                try:
                    outcome = future.result()
                except Exception as error:  # a dead worker fails its job only
                    outcome = {"result": None, "error": repr(error), "job_wall_seconds": 0.0}
                finish(job, outcome)
    finally:  # Ctrl-C: queued jobs are dropped; finished ones stay cached for the resume
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        # Every finished job, in plan order (all of them unless the run was stopped).
        records = [done[j.id] for j in planned if j.id in done]
        (out / "runs.jsonl").write_text("".join(dump(r) + "\n" for r in records))
    return records


class _NoBar:
    def update(self, n: int) -> None: ...

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None: ...


def _bar(total: int, done: int, show: bool) -> Any:
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="study jobs", unit="job", dynamic_ncols=True)

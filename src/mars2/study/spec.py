"""A study file (``configs/study/<name>.yaml``): task, settings, arms, seeds, hypotheses, analysis.

Loaded into plain dicts and validated loudly: a study that names an arm, agent or measure that
does not exist is refused before anything runs.

Measures (what a hypothesis compares, one value per seed) are written ``<source>:<metric>``:

- ``<arm>/<agent>:pass1`` test pass@1 of that arm's trained agent (``warm/<agent>`` the warm
  start); ``:gain`` the same minus the warm start's; ``:flat_public`` / ``:flat_vote`` flat
  sampling at the tree's node budget, the answer chosen by public tests / majority vote;
- ``<evaluation>:mcts`` / ``:passN`` Pass@1(MCTS) / Pass@N of an evaluation tree;
- ``flat/<evaluation>:public`` / ``:vote`` flat sampling of that evaluation's agents at the same
  node budget (an equal share of samples from each), chosen by public tests / majority vote;
- ``aa/<agent>:pass1`` the A/A stream (the warm start evaluated on a second sample stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ARM_KEYS = {"name", "members", "per_agent", "search", "nodes", "gamma", "note"}
SAMPLE_METRICS = ("pass1", "gain", "flat_public", "flat_vote")
TREE_METRICS = ("mcts", "passN")
SETTINGS = ("steps", "problems_per_step", "lr", "temperature", "max_new_tokens", "warm_epochs",
            "check_samples", "test_samples", "eval_nodes")  # fmt: skip


class StudyError(ValueError):
    """A study file that cannot be run as written."""


@dataclass(frozen=True)
class Study:
    name: str
    path: Path
    raw: dict[str, Any]

    @property
    def task(self) -> dict[str, Any]:
        return dict(self.raw["task"])

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.raw["settings"])

    @property
    def seeds(self) -> list[int]:
        return [int(s) for s in self.raw["seeds"]]

    @property
    def agents(self) -> list[str]:
        return list(self.raw["task"]["agents"])

    @property
    def analysis(self) -> dict[str, Any]:
        return dict(self.raw["analysis"])

    def training_runs(self) -> list[dict[str, Any]]:
        """One entry per trained arm instance: a per-agent arm gives one per agent."""
        runs = []
        for arm in self.raw["arms"]:
            groups = [[a] for a in self.agents] if arm.get("per_agent") else [arm["members"]]
            for members in groups:
                runs.append({"arm": arm["name"], "members": list(members),
                             "search": arm["search"], "nodes": int(arm["nodes"]),
                             "gamma": float(arm["gamma"])})  # fmt: skip
        return runs

    def sources(self) -> set[str]:
        """Every ``<arm>/<agent>`` whose weights exist after training, and ``warm/<agent>``."""
        found = {f"warm/{a}" for a in self.agents}
        for run in self.training_runs():
            found |= {f"{run['arm']}/{m}" for m in run["members"]}
        return found

    def evaluations(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.raw.get("evaluations", [])]

    def comparisons(self) -> list[dict[str, Any]]:
        """Primary then secondary comparisons, each with its family."""
        out = []
        for family in ("primary", "secondary"):
            for c in self.raw["hypotheses"].get(family, []):
                out.append({**c, "family": family})
        return out


def _need(raw: dict[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise StudyError(f"{where}: missing key {key!r}")
    return raw[key]


def load_study(path: str | Path) -> Study:
    """Read and validate a study file."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"no study file at {path}: pass the path of configs/study/<name>.yaml")
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise StudyError(f"{path}: a study file is a mapping")
    where = str(path)
    name = _need(raw, "name", where)
    task = _need(raw, "task", where)
    if task.get("data") != "skills":
        raise StudyError(f"{where}: task.data must be 'skills' (the only study task so far)")
    _need(task, "layout", f"{where} task")
    agents = _need(task, "agents", f"{where} task")
    settings = _need(raw, "settings", where)
    missing = [k for k in SETTINGS if k not in settings]
    if missing:
        raise StudyError(f"{where}: settings lacks {missing}")
    seeds = _need(raw, "seeds", where)
    if not seeds or len(set(seeds)) != len(seeds):
        raise StudyError(f"{where}: seeds must be a non-empty list of distinct integers")
    overlap = set(seeds) & set(raw.get("validation_seeds", []))
    if overlap:
        raise StudyError(f"{where}: seeds {sorted(overlap)} are also validation seeds")
    names = set()
    for arm in _need(raw, "arms", where):
        unknown = set(arm) - ARM_KEYS
        if unknown:
            raise StudyError(f"{where}: arm {arm.get('name')!r} has unknown keys {sorted(unknown)}")
        for key in ("name", "search", "nodes", "gamma"):
            _need(arm, key, f"{where} arm {arm.get('name')!r}")
        if arm["name"] in names or arm["name"] in ("warm", "aa"):
            raise StudyError(f"{where}: arm name {arm['name']!r} is repeated or reserved")
        names.add(arm["name"])
        if not arm.get("per_agent"):
            bad = [
                m for m in _need(arm, "members", f"{where} arm {arm['name']}") if m not in agents
            ]
            if bad:
                raise StudyError(f"{where}: arm {arm['name']!r} names unknown agents {bad}")
        if arm["search"] not in ("grpo", "mars2"):
            raise StudyError(f"{where}: arm {arm['name']!r}: search is 'grpo' or 'mars2'")
    study = Study(str(name), path, raw)
    sources = study.sources()
    evaluations = set()
    for e in study.evaluations():
        _need(e, "name", f"{where} evaluation")
        bad = [s for s in _need(e, "agents", f"{where} evaluation {e['name']}") if s not in sources]
        if bad:
            raise StudyError(f"{where}: evaluation {e['name']!r} uses unknown weights {bad}")
        evaluations.add(e["name"])
    analysis = _need(raw, "analysis", where)
    for key in ("alpha", "margin", "level"):
        _need(analysis, key, f"{where} analysis")
    hypotheses = _need(raw, "hypotheses", where)
    if not hypotheses.get("primary"):
        raise StudyError(f"{where}: hypotheses.primary is empty: a study states what it tests")
    for c in study.comparisons():
        for side in ("a", "b"):
            check_measure(_need(c, side, f"{where} comparison {c.get('id')}"), sources,
                          evaluations, where)  # fmt: skip
        if c.get("direction", "greater") not in ("greater", "less", "two-sided"):
            raise StudyError(f"{where}: comparison {c['id']}: direction greater/less/two-sided")
    for m in raw.get("manipulation", []):
        check_measure(m, sources, evaluations, where)
    return study


def check_measure(measure: str, sources: set[str], evaluations: set[str], where: str) -> None:
    source, _, metric = measure.partition(":")
    if source in evaluations and metric in TREE_METRICS:
        return
    if source.startswith("flat/") and source[5:] in evaluations and metric in ("public", "vote"):
        return
    base = source.replace("aa/", "warm/", 1) if source.startswith("aa/") else source
    if base in sources and metric in SAMPLE_METRICS:
        return
    raise StudyError(
        f"{where}: measure {measure!r} is not '<arm>/<agent>:{'|'.join(SAMPLE_METRICS)}' of a "
        f"trained arm (or warm/ or aa/) nor '<evaluation>:{'|'.join(TREE_METRICS)}'"
    )

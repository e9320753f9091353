"""Fetch the public datasets and write them as the files `mars2.data.loaders` reads.

- LiveCodeBench (``livecodebench/code_generation_lite``): release ``vN`` is the union of the
  files ``test.jsonl``, ``test2.jsonl`` ... ``testN.jsonl`` (each holds the problems a release
  added). Rows are kept verbatim (the loader reads the official format, private tests
  base64-zlib-pickle compressed) in ``<data>/livecodebench/release_vN.jsonl``; the data config's
  date window then picks the problems (``data.eval.start_date``/``end_date``).
- DeepCoder (``agentica-org/DeepCoder-Preview-Dataset``): subsets ``primeintellect``, ``taco``,
  ``lcbv5`` and ``codeforces``, each with its own test format, converted to the
  ``prompt`` + ``label{inputs, outputs, fn_name}`` rows of `load_deepcoder` in
  ``<data>/deepcoder/train.jsonl``.

The download needs the Hugging Face hub (``huggingface_hub``, installed with transformers); the
conversion is plain Python and is what the tests check, on rows built in the official formats.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars2.data.loaders import load_deepcoder, load_livecodebench
from mars2.data.problem import Problem

LCB_REPO = "livecodebench/code_generation_lite"
LCB_RELEASES = 6
DEEPCODER_REPO = "agentica-org/DeepCoder-Preview-Dataset"
DEEPCODER_SUBSETS = ("primeintellect", "taco", "lcbv5", "codeforces")
DEEPCODER_TRAIN = ("primeintellect", "taco", "lcbv5")  # DeepCoder's training mix


class FetchError(RuntimeError):
    """A dataset that could not be fetched or converted; the message says what to do."""


def lcb_files(release: str) -> list[str]:
    """The files of LiveCodeBench release `release` (``v6`` or ``release_v6``), oldest first."""
    number = release.lower().removeprefix("release_").removeprefix("v")
    if not number.isdigit() or not 1 <= int(number) <= LCB_RELEASES:
        raise FetchError(
            f"unknown LiveCodeBench release {release!r}: use v1 ... v{LCB_RELEASES} "
            "(release vN holds every problem up to it)"
        )
    return ["test.jsonl", *(f"test{i}.jsonl" for i in range(2, int(number) + 1))]


# --- DeepCoder rows -> load_deepcoder rows ------------------------------------------------------


def _unwrap(value: Any) -> Any:
    """Call-based expected outputs of TACO/APPS and PrimeIntellect come wrapped in a one-element
    list (their checkers accept the value or the list); the loader wants the value."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _json_lines(text: str) -> list[Any]:
    """LiveCodeBench functional inputs: one JSON value per line, one line per argument."""
    return [json.loads(line) for line in str(text).split("\n") if line.strip()]


def deepcoder_label(subset: str, tests: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """The ``label`` of `load_deepcoder` from one DeepCoder row's ``tests`` (decoded JSON)."""
    if isinstance(tests, dict):  # taco: {"inputs": [...], "outputs": [...], "fn_name"?}
        fn_name = tests.get("fn_name") or None
        expected = list(tests.get("outputs") or [])
        return {
            "inputs": list(tests.get("inputs") or []),
            "outputs": [_unwrap(o) for o in expected] if fn_name else expected,
            "fn_name": fn_name,
        }
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{subset}: tests must be a non-empty list or an inputs/outputs object")
    fn_name = metadata.get("func_name") or next(
        (t.get("fn_name") for t in tests if isinstance(t, dict) and t.get("fn_name")), None
    )
    inputs: list[Any] = []
    outputs: list[Any] = []
    for test in tests:
        kind = test.get("testtype") or test.get("type") or "stdin"
        if kind == "functional":  # lcbv5: JSON lines in, JSON out
            inputs.append(_json_lines(test["input"]))
            outputs.append(json.loads(test["output"]))
        elif kind == "function_call":  # primeintellect: a list of arguments in, [value] out
            args = test["input"]
            inputs.append(args if isinstance(args, list) else [args])
            outputs.append(_unwrap(test["output"]))
        else:  # stdin / stdin_stdout
            inputs.append(str(test["input"]))
            outputs.append(str(test["output"]))
    return {"inputs": inputs, "outputs": outputs, "fn_name": fn_name}


def deepcoder_row(subset: str, index: int, row: dict[str, Any]) -> dict[str, Any]:
    """One DeepCoder row (``problem``, ``tests``, ``metadata``, ``starter_code``?) as a row of
    `load_deepcoder`, with a stable id ``deepcoder/<subset>/<index>``."""
    tests = row.get("tests")
    tests = json.loads(tests) if isinstance(tests, str) else tests
    metadata = row.get("metadata") or {}
    metadata = json.loads(metadata) if isinstance(metadata, str) else dict(metadata)
    out = {
        "id": f"deepcoder/{subset}/{index}",
        "prompt": str(row.get("problem") or row.get("question") or ""),
        "label": deepcoder_label(subset, tests, metadata),
        "starter_code": str(row.get("starter_code") or ""),
        "difficulty": str(metadata.get("difficulty") or row.get("difficulty") or ""),
        "source": subset,
    }
    if not out["prompt"]:
        raise ValueError(f"{subset} row {index}: no problem statement")
    return out


# --- writing and summarising --------------------------------------------------------------------


@dataclass
class Written:
    """What a fetch wrote: the file, its problems, and counts to print."""

    path: Path
    problems: list[Problem]
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """Counts per platform and difficulty and the contest-date range, one line each."""
        platforms = Counter(
            str(p.metadata.get("platform") or p.metadata.get("source") or "?")
            for p in self.problems
        )
        difficulties = Counter(str(p.metadata.get("difficulty") or "?") for p in self.problems)
        dates = sorted(str(p.metadata["contest_date"]) for p in self.problems
                       if p.metadata.get("contest_date"))  # fmt: skip
        lines = [
            f"wrote {len(self.problems)} problems to {self.path}",
            "  by platform:   " + ", ".join(f"{k} {v}" for k, v in sorted(platforms.items())),
            "  by difficulty: " + ", ".join(f"{k} {v}" for k, v in sorted(difficulties.items())),
        ]
        if dates:
            lines.append(f"  contest dates: {dates[0]} to {dates[-1]}")
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} rows (first: {self.skipped[0]})")
        return "\n".join(lines)


def _write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> int:
    """Write rows to `path` through a temporary file (a failed fetch leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count


def write_livecodebench(sources: Iterable[Path], path: Path) -> Written:
    """Concatenate LiveCodeBench files (rows verbatim, duplicates by question_id dropped) into
    `path` and check that the loader reads every row."""

    def rows() -> Iterator[dict[str, Any]]:
        seen: set[str] = set()
        for source in sources:
            with open(source, encoding="utf-8") as handle:
                for line in handle:
                    if line.strip():
                        row = json.loads(line)
                        if row.get("question_id") not in seen:
                            seen.add(row.get("question_id"))
                            yield row

    _write_jsonl(rows(), path)
    return Written(path, load_livecodebench(path))


def write_deepcoder(subsets: dict[str, Iterable[dict[str, Any]]], path: Path) -> Written:
    """Convert DeepCoder rows (by subset) into `path`; rows whose tests cannot be read are
    skipped and counted (each named in the summary), every written row loads."""
    skipped: list[str] = []

    def rows() -> Iterator[dict[str, Any]]:
        for subset, source in subsets.items():
            for index, row in enumerate(source):
                try:
                    yield deepcoder_row(subset, index, row)
                except (ValueError, KeyError, TypeError) as error:
                    skipped.append(f"{subset}/{index}: {error}")

    _write_jsonl(rows(), path)
    return Written(path, load_deepcoder(path), skipped)


# --- the download (needs the hub) ---------------------------------------------------------------


def hub_reachable(timeout: float = 5.0) -> str | None:
    """None when the hub (``HF_ENDPOINT``, by default huggingface.co) answers on its port, else
    why not: checked once up front instead of letting every download retry for half a minute."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or 443
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        return f"{host}:{port} cannot be reached ({error.strerror or error})"
    return None


def _hub_call(what: str, call: Callable[[], Any]) -> Any:
    why = hub_reachable()
    if why is not None:
        raise FetchError(
            f"cannot fetch {what}: {why}. mars2-data downloads from the Hugging Face hub and "
            "needs network access to it; on a machine without it, run it elsewhere and copy the "
            "written file into the data folder."
        )
    try:
        return call()
    except FetchError:
        raise
    except ImportError as error:
        raise FetchError(
            f"{what} needs huggingface_hub (pip install 'mars2[data]'): {error}"
        ) from error
    except Exception as error:  # offline mode, no route, DNS, HTTP errors: all say the same
        raise FetchError(
            f"could not fetch {what} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no details'}). mars2-data needs "
            "network access to huggingface.co (and HF_HUB_OFFLINE unset); on a machine without "
            "it, run it elsewhere and copy the written file into the data folder."
        ) from error


def fetch_livecodebench(release: str, data_dir: Path) -> Written:
    """Download LiveCodeBench release `release` and write ``release_vN.jsonl``."""
    files = lcb_files(release)
    number = len(files)

    def download() -> list[Path]:
        from huggingface_hub import hf_hub_download

        return [
            Path(hf_hub_download(LCB_REPO, name, repo_type="dataset")) for name in files
        ]  # fmt: skip

    sources = _hub_call(f"LiveCodeBench release v{number}", download)
    return write_livecodebench(sources, data_dir / "livecodebench" / f"release_v{number}.jsonl")


def fetch_deepcoder(subsets: Iterable[str], split: str, data_dir: Path) -> Written:
    """Download DeepCoder's `subsets` (their `split`) and write ``deepcoder/<split>.jsonl``."""
    chosen = list(subsets)
    unknown = [s for s in chosen if s not in DEEPCODER_SUBSETS]
    if unknown:
        raise FetchError(f"unknown DeepCoder subsets {unknown}: use {list(DEEPCODER_SUBSETS)}")

    def download() -> dict[str, list[dict[str, Any]]]:
        import pyarrow.parquet as pq
        from huggingface_hub import HfApi, hf_hub_download

        files = HfApi().list_repo_files(DEEPCODER_REPO, repo_type="dataset")
        tables: dict[str, list[dict[str, Any]]] = {}
        for subset in chosen:
            names = sorted(f for f in files if f.startswith(f"{subset}/")
                           and f.endswith(".parquet") and Path(f).name.startswith(split))  # fmt: skip
            if not names:
                raise FetchError(f"DeepCoder has no {split} files for subset {subset!r}")
            tables[subset] = [
                row
                for name in names
                for row in pq.read_table(
                    hf_hub_download(DEEPCODER_REPO, name, repo_type="dataset")
                ).to_pylist()
            ]
        return tables

    tables = _hub_call(f"DeepCoder ({', '.join(chosen)})", download)
    return write_deepcoder(tables, data_dir / "deepcoder" / f"{split}.jsonl")

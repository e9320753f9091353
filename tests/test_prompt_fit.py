"""Rows too long for an agent's prompt cap (issue #43 point 2): refused before any model loads,
naming the file and row, the agent, the length, the cap and the fixes, or left out and counted
with ``too_long=skip``; and refinement prompts cut to fit are counted in every step's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from mars2.builders import build_problems
from mars2.data.loaders import load_deepcoder
from mars2.generation.prompt import encode_prompt
from mars2.models.loading import load_tokenizer
from mars2.search.prompt_fit import PromptCap, fitting_problems, uncut_prompt_length
from mars2.search.prompts import PromptBuilder
from mars2.utils.validation import ConfigError

REPO = Path(__file__).resolve().parents[1]
# Each short row's prompt is about 150 tokens with the tiny tokenizers; the long one about 2,000.
CAP = 400


def _rows(tmp_path: Path) -> Path:
    """Two short rows, a long one as row 3, one more short row (DeepCoder format)."""
    statements = ["echo", "add one", "words " * 1500, "double"]
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": s, "label": {"inputs": ["1"], "outputs": ["1"]}})
            + "\n"
            for i, s in enumerate(statements)
        )
    )
    return path


def _cap(tiny: Path, agent: str = "tiny_qwen3") -> PromptCap:
    return PromptCap(agent, load_tokenizer(str(tiny / agent)), CAP)


def test_the_lengths_are_the_generators_encoding(tmp_path: Path, tiny_models_dir: Path) -> None:
    cap = _cap(tiny_models_dir)
    problems = load_deepcoder(_rows(tmp_path))
    builder = PromptBuilder()
    short = len(encode_prompt(cap.tokenizer, builder.fresh_messages(problems[0])))
    assert uncut_prompt_length(problems[0], builder, cap.tokenizer) >= short
    assert short < CAP < uncut_prompt_length(problems[2], builder, cap.tokenizer)


def test_refuse_names_the_row_agent_length_cap_and_fixes(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    path = _rows(tmp_path)
    cap = _cap(tiny_models_dir)
    problems = load_deepcoder(path)
    length = uncut_prompt_length(problems[2], PromptBuilder(), cap.tokenizer)
    with pytest.raises(ConfigError) as caught:
        fitting_problems(problems, PromptBuilder(), [cap], "refuse", "train")
    message = str(caught.value)
    assert f"{path}:3" in message and "tiny_qwen3" in message, message
    assert f"{length} tokens" in message and f"max_prompt_tokens={CAP}" in message
    assert "data.train.too_long=skip" in message and "Raise the cap" in message
    assert "\n" not in message
    # a limit that stops before the long row needs nothing left out
    kept, left_out = fitting_problems(problems, PromptBuilder(), [cap], "refuse", "eval", limit=2)
    assert [p.id for p in kept] == ["p0", "p1"] and not left_out
    with pytest.raises(ConfigError, match="too_long=drop is not a choice"):
        fitting_problems(problems, PromptBuilder(), [cap], "drop", "train")


def _compose(tmp_path: Path, tiny: Path, *overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(
            config_name="train",
            overrides=[
                "experiment=tiny_pair", "data=deepcoder", "warm_start=null",
                f"data.train.path={_rows(tmp_path)}", f"paths.output_dir={tmp_path}",
                f"paths.log_dir={tmp_path}/logs", f"paths.tiny_models_dir={tiny}", *overrides,
            ],
        )  # fmt: skip


def test_skip_leaves_the_row_out_and_counts_it(
    tmp_path: Path, tiny_models_dir: Path, caplog
) -> None:
    """Through the config: the setting sits on the data split (not passed to the loader), the
    cap on one agent (tiny_llama, the other, has none)."""
    cfg = _compose(
        tmp_path, tiny_models_dir,
        f"agents.tiny_qwen3.generation.max_prompt_tokens={CAP}", "data.train.too_long=skip",
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        problems = build_problems(cfg, "train")
    assert [p.id for p in problems] == ["p0", "p1", "p3"]
    assert "left out 1 row(s)" in caplog.text and f"{tmp_path / 'rows.jsonl'}:3" in caplog.text
    uncapped = _compose(tmp_path, tiny_models_dir)  # no cap: every row, no tokenizer needed
    assert len(build_problems(uncapped, "train")) == 4


@pytest.mark.slow
@pytest.mark.parametrize("how", ["default-run-dir", "hydra.run.dir", "-m"])
def test_training_refuses_a_too_long_row_before_models_load(
    tmp_path: Path, tiny_models_dir: Path, how: str
) -> None:
    """The command line's check, with and without hydra.run.dir and for every job of a sweep:
    one paragraph, no model."""
    path = _rows(tmp_path)
    command = [
        sys.executable, str(REPO / "src/mars2/train.py"), "experiment=tiny_pair", "data=deepcoder",
        "warm_start=null", f"data.train.path={path}", f"paths.log_dir={tmp_path / 'logs'}",
        f"paths.tiny_models_dir={tiny_models_dir}",
        f"agents.tiny_llama.generation.max_prompt_tokens={CAP}",
    ]  # fmt: skip
    if how == "hydra.run.dir":
        command.append(f"hydra.run.dir={tmp_path / 'chosen'}")
    if how == "-m":
        command += ["-m", "seed=1,2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("Error: data.train"), done.stderr[-3000:]
    assert f"{path}:3" in errors[0] and "tiny_llama" in errors[0] and "too_long=skip" in errors[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert "Loading" not in done.stdout + done.stderr  # refused before any model work
    assert not (tmp_path / "chosen").exists() and not (tmp_path / "logs").exists()


def test_cut_prompts_are_marked_and_counted_per_agent(tiny_models_dir: Path) -> None:
    """A step whose refinements show a long previous attempt: every prompt cut to the cap is
    marked on its completion and counted in the step's metrics (`<agent>/prompts_cut`)."""
    from mars2.generation.transformers_backend import ScriptedGenerator
    from mars2.search.runner import SearchConfig, TreeSearch
    from mars2.search.simulation.environment import SimulatedGrader, simulated_problems
    from mars2.training.rollout import ProblemSchedule, RolloutEngine

    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_qwen3"))
    body = "".join(f"x{i} = {i}\n" for i in range(300))
    answer = f"```python\n# outcome: fail 0.100\n{body}print(1)\n```"  # graded wrong: refined
    generators = {
        "a": ScriptedGenerator(tokenizer, lambda chat: answer, max_prompt_tokens=CAP),
        "b": ScriptedGenerator(tokenizer, lambda chat: answer),  # no cap: nothing cut
    }
    search = TreeSearch(SearchConfig(max_nodes=6, expansions_per_round=2))
    engine = RolloutEngine(
        ProblemSchedule(simulated_problems(2), per_step=2, seed=0), search, SimulatedGrader()
    )
    data = engine.run(0, generators)
    nodes = [n for t in data.trees for n in t.answers()]
    refined_by_a = [n for n in nodes if n.agent == "a" and n.depth > 1]
    assert refined_by_a, "the search refined nothing with agent a"
    assert all(n.completion.prompt_cut for n in refined_by_a)
    assert all(len(n.completion.prompt_token_ids) <= CAP for n in refined_by_a)
    assert not any(n.completion.prompt_cut for n in nodes if n.agent == "b" or n.depth == 1)
    assert data.metrics["a/prompts_cut"] == len(refined_by_a)
    assert data.metrics["b/prompts_cut"] == 0
    assert data.metrics["prompts_cut"] == len(refined_by_a)


def test_the_transformers_generator_marks_a_cut_prompt(tiny_models_dir: Path) -> None:
    from mars2.generation.prompt import CUTTABLE
    from mars2.generation.transformers_backend import TransformersGenerator
    from mars2.models.loading import ModelSpec, load_policy

    path = str(tiny_models_dir / "tiny_llama")
    code = "".join(f"y{i} = {i}\n" for i in range(300))
    refine = [{"role": "user", "content": f"Fix this:\n{code}", CUTTABLE: code}]
    fresh = [{"role": "user", "content": "Write a program."}]
    generator = TransformersGenerator(
        load_policy(ModelSpec(path)), load_tokenizer(path), max_new_tokens=2, max_prompt_tokens=CAP
    )
    cut, whole = generator.generate([refine, fresh])
    assert cut.prompt_cut and len(cut.prompt_token_ids) <= CAP
    assert not whole.prompt_cut


def test_evaluation_checks_its_rows_too(tmp_path: Path, tiny_models_dir: Path) -> None:
    """`mars2-eval`'s check (before any model loads) on LiveCodeBench rows: refused naming the
    row, or left out with data.eval.too_long=skip."""
    from mars2.eval.run import check_eval

    path = tmp_path / "lcb.jsonl"
    tests = json.dumps([{"input": "1", "output": "1"}])
    path.write_text(
        "".join(
            json.dumps({"question_id": f"q{i}", "question_content": s, "public_test_cases": tests})
            + "\n"
            for i, s in enumerate(["echo", "add one", "words " * 1500, "double"])
        )
    )

    def compose_eval(*overrides: str) -> Any:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return compose(
                config_name="eval",
                overrides=[
                    "experiment=tiny_pair", "data=deepcoder", f"data.eval.path={path}",
                    "data.eval.start_date=null", "data.eval.end_date=null",
                    f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}/logs",
                    f"paths.tiny_models_dir={tiny_models_dir}", "eval.allow_untrained=true",
                    f"agents.tiny_qwen3.generation.max_prompt_tokens={CAP}", *overrides,
                ],
            )  # fmt: skip

    with pytest.raises(ConfigError, match=rf"^data\.eval: {path}:3 \(problem 'q2'\)"):
        check_eval(compose_eval())
    kept = check_eval(compose_eval("data.eval.too_long=skip", "+eval.limit=3"))
    assert [p.id for p in kept] == ["q0", "q1", "q3"]


def test_a_data_config_of_ones_own_takes_the_setting_with_a_plus(tmp_path: Path) -> None:
    """A split without the key (a user's data config): `+data.train.too_long=skip` is accepted
    by the command line's checks, the setting without `+` is told to add it, a typo is named."""
    from mars2.cli.errors import CommandLineError
    from mars2.cli.preflight import preflight

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text(
        "train:\n  _target_: mars2.data.sources.toy\n  part: train\n"
        "eval:\n  _target_: mars2.data.sources.toy\n  part: held_out\n"
    )
    base = ["experiment=tiny_pair", f"hydra.searchpath=[file://{tmp_path}]", "data=mine"]
    preflight("train", [*base, "+data.train.too_long=skip", "--cfg", "job"])
    with pytest.raises(CommandLineError, match=r"add it with \+data\.train\.too_long="):
        preflight("train", [*base, "data.train.too_long=skip", "--cfg", "job"])
    with pytest.raises(CommandLineError, match=r"did you mean data\.train\.too_long"):
        preflight("train", [*base, "+data.train.too_lng=skip", "--cfg", "job"])

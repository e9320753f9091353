"""A trainer=fsdp run for tests/test_sharding.py; Lightning starts this script again per rank.

tiny_qwen3 answers from a script (right or wrong by a hash of the prompt, so rewards are mixed and
its weights move); tiny_llama samples from its own sharded policy.
    python tests/fsdp_run.py <hydra overrides>
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from mars2.builders import build_problems
from mars2.generation.transformers_backend import ScriptedGenerator
from mars2.training.run import build_run

REPO = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    problems = build_problems(cfg, "train")
    reference = {p.statement: p.metadata["reference_solution"] for p in problems}

    def answer(chat: list[dict[str, str]]) -> str:
        text = chat[-1]["content"]
        statement = next(s for s in reference if s in text)
        right = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 2 == 0
        return f"```python\n{reference[statement] if right else 'print(0)'}\n```"

    module, datamodule, trainer, sandbox = build_run(cfg)
    agent = module.agent("tiny_qwen3")
    agent.generator = ScriptedGenerator(agent.tokenizer, answer)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    finally:
        sandbox.close()


if __name__ == "__main__":
    main(sys.argv[1:])

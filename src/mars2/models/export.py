"""Writing a trained policy out in Hugging Face format."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def export_pretrained(policy: Any, tokenizer: Any, path: str | Path) -> Path:
    """Save `policy` and `tokenizer` under `path`, loadable with the Auto* classes.

    A LoRA (PEFT) policy writes its adapter only; load it on top of its base model.
    """
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target

"""`EvalSettings`: what an evaluation measures (the `eval:` block of configs/eval.yaml)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalSettings:
    """n samples per problem for pass@k, the node budget of each tree, and which problems.

    Every field defines the numbers an evaluation reports, so a resumed evaluation reuses rows
    only from a run with the same settings (see mars2.utils.runs).
    """

    samples: int = 4  # n samples per problem for pass@k (k = 1..n)
    temperature: float = 1.0
    tree_budget: int = 60  # nodes per tree for Pass@1(MCTS) and Pass@N
    limit: int | None = None  # evaluate only the first N problems
    chunk: int | None = 32  # problems whose trees grow together; a resume redoes at most one
    allow_untrained: bool = False  # evaluate without ckpt_path (the agents' initial weights)
    tree_pages: int | None = None  # HTML pages of the team's trees, in problem order (None: all)

    def __post_init__(self) -> None:
        for name in ("samples", "tree_budget", "limit", "chunk", "tree_pages"):
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        if self.samples is None or self.tree_budget is None:
            raise ValueError("samples and tree_budget must be set")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")

"""One console line per log message.

Lightning gives its loggers their own console handler when it is imported before logging is set
up; under Hydra, which then puts its handler on the root logger, every Lightning message was
printed twice (once per handler). Once the root logger has a handler, the extra ones go.
"""

from __future__ import annotations

import logging

_OWN_HANDLERS = ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric")


def one_line_per_message() -> None:
    """Drop library console handlers that duplicate the root logger's (when it has one)."""
    root = logging.getLogger()
    if not root.handlers:
        return
    for name in _OWN_HANDLERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            ):
                logger.removeHandler(handler)
        logger.propagate = True


# Library messages that say nothing about the run: adverts, the accelerator lines Lightning prints
# at every start (the trainer config says what is used; a missing GPU is refused before the run),
# and MLflow creating an experiment that a first run of course does not find.
_ACCELERATORS = tuple(f"{kind} available:" for kind in ("GPU", "TPU", "HPU", "IPU", "MPS"))
_NOISE = {
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip", *_ACCELERATORS),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip", *_ACCELERATORS),
    "lightning.pytorch.loggers.mlflow": ("Experiment with name",),
    # The tokenizer's model_max_length is not the run's prompt cap: generation.max_prompt_tokens
    # is, and rows too long for it are refused or left out before the run (data.*.too_long).
    "transformers.tokenization_utils_base": ("Token indices sequence length is longer",),
}


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(self.prefixes)


def quiet_libraries() -> None:
    """Silence library adverts, per-file progress bars (weight loading, shard writing) and
    MLflow's set-up chatter in our commands; warnings and errors still show."""
    for name, prefixes in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))
    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass

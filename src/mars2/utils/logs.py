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

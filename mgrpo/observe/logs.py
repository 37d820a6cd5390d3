"""How mgrpo's log lines look, on every front door: `mgrpo-train` and `Trainer(config).fit()` from Python print the
same start-up and step lines, unless the user configured logging first (then theirs wins)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


def default_logging() -> None:
    """INFO lines of the 'mgrpo' loggers to stderr, when nobody has configured logging in this process."""
    logger = logging.getLogger("mgrpo")
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt=DATEFMT))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

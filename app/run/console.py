"""Lines a run prints for its user while a progress bar runs (the validations' results, how long the run will take,
skipped updates): through ``tqdm.write``, each on a line of its own above the bar and never glued to it, and, as
every log record, into the command's log file (``train.log``), where a user reads the run afterwards."""

from __future__ import annotations

import logging

from tqdm import tqdm


def announce(text: str, logger: logging.Logger, level: int = logging.INFO) -> None:
    """``text`` on the console above the bar, and in the log files of the root logger's handlers (``logger``: whose
    name the file's line carries)."""
    tqdm.write(text)
    record = logger.makeRecord(logger.name, level, __file__, 0, text, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and level >= handler.level:
            handler.handle(record)

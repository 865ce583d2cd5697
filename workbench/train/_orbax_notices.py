"""The two Orbax log notices a run's checkpoints drop (absl's logger; only those messages)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

#: What Orbax's CheckpointManager logs (absl, WARNING) on every read-only open: the
#: ``read_only=True`` asked for, said back. ``without_read_only_notice`` drops it.
_READ_ONLY_NOTICE = "Given directory is read only=%s"


class _DropReadOnlyNotice(logging.Filter):
    """Drops Orbax's read-only notice for one directory; every other record passes."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _READ_ONLY_NOTICE and isinstance(record.args, tuple)
                    and len(record.args) == 1 and str(record.args[0]) == self.directory)


@contextlib.contextmanager
def _absl_without(drop: logging.Filter) -> Iterator[None]:
    """While inside: the records ``drop`` refuses are not logged by absl's logger."""
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(drop)
    try:
        yield
    finally:
        absl_logger.removeFilter(drop)


def without_read_only_notice(directory: Path) -> contextlib.AbstractContextManager[None]:
    """While Orbax opens ``directory``: its "Given directory is read only" notice for that
    directory is not logged (absl's logger; only that message, only for that directory)."""
    return _absl_without(_DropReadOnlyNotice(directory))


#: What Orbax's ``CheckpointManager.save`` logs (absl, WARNING) when the waits for earlier
#: saves since its last save passed a second: it adds up every ``wait_until_finished`` on the
#: main thread, so the wait a finished run makes for its last save (``Checkpoints.wait``) is
#: reported at the next run's first save as "consider checkpointing less frequently". The
#: Trainer times what a save blocks itself (``ckpt_time`` of each step's record), so
#: ``without_wait_notice`` drops this message during Checkpoints' own saves.
_WAIT_NOTICE = "Waiting for previous save to complete took"


class _DropWaitNotice(logging.Filter):
    """Drops Orbax's "Waiting for previous save" notice; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_WAIT_NOTICE))


def without_wait_notice() -> contextlib.AbstractContextManager[None]:
    """While one of Checkpoints' saves is handed to Orbax: its "Waiting for previous save"
    notice is not logged (absl's logger; only that message)."""
    return _absl_without(_DropWaitNotice())

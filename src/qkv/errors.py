"""One exception type for every user-facing error.

The CLI catches :class:`QkvError`, prints its message (which names the file, the line or the
config field at fault) and exits with status 2 (or the error's own ``exit_code``), never with a
traceback.
"""

import importlib
from types import ModuleType


class QkvError(Exception):
    """A problem with the user's input: a file, a config value, a checkpoint."""

    exit_code = 2


class CorpusError(QkvError):
    """A corpus file is missing, unreadable, or malformed."""


class ConfigError(QkvError):
    """A configuration value is out of range or unknown."""


class CheckpointError(QkvError):
    """A checkpoint directory is missing, incomplete or corrupt."""


class TrainingDiverged(QkvError):
    """Training stopped on non-finite losses or weights; nothing non-finite was written. Exit status 3."""

    exit_code = 3


class Unavailable(QkvError):
    """A part of the program that answers requests cannot answer now (a worker process ended, stopped
    answering or could not be started): a failure of the program, not of the input. ``retry_after``:
    the seconds after which to try again (``qkv serve`` answers 503 with that ``Retry-After``)."""

    def __init__(self, message: str = "", retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


def require_package(package: str, what: str, pinned: dict[str, str], install: str) -> ModuleType:
    """Import the optional ``package`` that ``what`` needs (e.g. "--format hf", "qkv serve"), or a
    QkvError naming its tested version (from ``pinned``) and the ``install`` command of its extra."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise QkvError(f"{what} needs the {package} package ({pinned.get(package, '')} is the tested version), "
                       f"which is not installed ({e}): {install}") from None

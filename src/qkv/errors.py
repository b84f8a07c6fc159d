"""One exception type for every user-facing error.

The CLI catches :class:`QkvError`, prints its message (which names the file, the line or the
config field at fault) and exits with status 2 (or the error's own ``exit_code``), never with a
traceback.
"""


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

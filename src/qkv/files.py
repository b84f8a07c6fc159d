"""Output files: checked before any work starts, written all or nothing.

:func:`atomic_output` writes a file to a temporary file beside it and renames it into place only
when the whole output is written (after an ``fsync``), so a failed or interrupted command never
leaves a truncated file, and ``--output`` may name a file that is still being read. Devices,
FIFOs and descriptor links (``/dev/null``, ``/dev/stdout``, ``/dev/full``, ``/proc/self/fd/1``)
are written in place: they cannot be renamed over. Every ``OSError`` of the writing becomes a
:class:`~qkv.errors.QkvError` naming the file (``ENOSPC``: "no space left on device (disk full)").
The temporary file's name holds the writer's pid (``.NAME.PID.XXXXXXXX.tmp``): one left behind by
a process that was killed outright (``kill -9``, a power cut) is removed by the next write of the
same output (:func:`remove_stale_temps`); one of a live process never is.

:func:`check_output_file` and :func:`check_output_dir` say, before a model is loaded or data
are read, whether a path can be written at all: not a directory where a file goes, a parent
that exists and takes new files. Writability is tried (a temporary file is made and removed),
not asked of ``os.access``, which answers yes to root whatever the file system says.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from qkv.errors import QkvError


def os_error_reason(e: OSError) -> str:
    """What went wrong, in words: the system's message, "disk full" spelled out for ENOSPC."""
    if e.errno == errno.ENOSPC:
        return "no space left on device (disk full)"
    if e.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return e.strerror.lower() if e.strerror else str(e)


def os_error_message(e: OSError, path: str | os.PathLike | None = None) -> str:
    """``PATH: reason`` for an OSError (the path given, else the one the error names, if any)."""
    name = path if path is not None else e.filename
    return f"{name}: {os_error_reason(e)}" if name is not None else os_error_reason(e)


@contextlib.contextmanager
def _naming(path: str | os.PathLike) -> Iterator[None]:
    """Turn an OSError into a QkvError that names ``path``."""
    try:
        yield
    except OSError as e:
        raise QkvError(os_error_message(e, path)) from None


def is_special(path: str | os.PathLike) -> bool:
    """True for what is written in place, never through a temporary file: an existing target that
    is not a regular file (a device, a FIFO, a socket), and any path under /dev or /proc (a link
    to an open descriptor such as /dev/stdout may point at a regular file that must not be replaced)."""
    p = Path(path).absolute()
    if p.parts[1:2] in (("dev",), ("proc",)):
        return True
    try:
        return not stat.S_ISREG(os.stat(p).st_mode)
    except FileNotFoundError:
        return False
    except OSError:
        return False  # e.g. a parent that is a file: opening it reports the problem


class _Output:
    """The handle :func:`atomic_output` yields: ``write`` and ``flush`` name the file in any error."""

    def __init__(self, fh: IO, path: str | os.PathLike):
        self.fh, self.path = fh, path

    def write(self, data) -> int:
        with _naming(self.path):
            return self.fh.write(data)

    def flush(self) -> None:
        with _naming(self.path):
            self.fh.flush()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, binary: bool = False) -> Iterator[_Output]:
    """Open ``path`` for writing, all or nothing.

    Yields a handle with ``write`` and ``flush``. Text is UTF-8 (``binary=False``). The data go
    to a temporary file in the same directory, which replaces ``path`` (``os.replace``, after
    ``fsync``) only when the block ends without an exception; on any exception, KeyboardInterrupt
    included, the temporary file is removed and ``path`` is as it was. A symlink is followed: the
    file it points to is replaced. Special targets (:func:`is_special`) are written directly.
    """
    mode = "wb" if binary else "w"
    encoding = None if binary else "utf-8"
    if is_special(path):
        with _naming(path):
            fh = open(path, mode, encoding=encoding)
        with _closing(fh, path):
            yield _Output(fh, path)
        return
    target = Path(os.path.realpath(path))
    remove_stale_temps(target.parent, re.escape(f".{target.name}.") + r"(?P<pid>\d+)\.\w+\.tmp")
    with _naming(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    try:
        fh = open(fd, mode, encoding=encoding)
        with _closing(fh, path, sync=True):
            yield _Output(fh, path)
        with _naming(path):
            os.chmod(tmp, _mode_for(target))
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (it may belong to another user). Where this cannot be asked
    (Windows), every process counts as alive."""
    if os.name == "nt":  # os.kill(pid, 0) sends CTRL_C_EVENT there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike, pattern: str) -> list[Path]:
    """Remove the entries of ``directory`` whose names match ``pattern`` (a regular expression with
    a ``pid`` group: the process that was writing them) and whose process is gone: what a writer
    killed outright left behind. Returns what was removed; what cannot be removed stays, quietly."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    removed = []
    for p in entries:
        m = re.fullmatch(pattern, p.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        removed.append(p)
    return removed


@contextlib.contextmanager
def _closing(fh: IO, path: str | os.PathLike, sync: bool = False) -> Iterator[None]:
    """Close ``fh`` after the block: flushed (and with ``sync`` fsynced) when the block succeeded,
    its errors naming ``path``; after a failed block closed quietly, so that the block's own
    exception is the one that propagates (a full disk fails the flush of ``close`` again)."""
    try:
        yield
        with _naming(path):
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
            fh.close()
    finally:
        with contextlib.suppress(OSError):
            fh.close()


def _mode_for(target: Path) -> int:
    """The permissions the written file gets: the replaced file's, or what ``open`` would give a new one."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


# --- checks before any work ------------------------------------------------------------------------

def _try_write_in(directory: Path, what: str) -> None:
    """Create and remove a temporary file in ``directory``; a QkvError saying why that fails."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".qkv-write-test.", dir=directory)
    except OSError as e:
        raise QkvError(f"{what}: cannot create files in {directory}: {os_error_reason(e)}") from None
    os.close(fd)
    os.unlink(tmp)


def check_output_file(path: str | os.PathLike, flag: str = "--output") -> None:
    """Fail now, with the reason, if a file cannot be written at ``path``: it is a directory, its
    directory does not exist (or is a file), or no file can be created there. Special targets
    (``/dev/null``, ``/dev/stdout``, a FIFO) pass."""
    p = Path(path)
    what = f"{flag} {path}"
    if p.is_dir():
        raise QkvError(f"{what}: is a directory (give a file name)")
    if is_special(p):
        return
    parent = Path(os.path.realpath(p)).parent
    if not parent.exists():
        raise QkvError(f"{what}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise QkvError(f"{what}: {parent} is not a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise QkvError(f"{what}: the file is not writable")
    _try_write_in(parent, what)


def check_output_dir(path: str | os.PathLike, flag: str = "--out") -> None:
    """Fail now, with the reason, if a directory cannot be made or written at ``path``: it exists
    and is not a directory, or its nearest existing ancestor is not a directory or takes no new
    entries."""
    p = Path(path).absolute()
    what = f"{flag} {path}"
    if p.exists() and not p.is_dir():
        raise QkvError(f"{what}: exists and is not a directory")
    ancestor = p
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QkvError(f"{what}: {ancestor} is a file, not a directory")
    _try_write_in(ancestor, what)


def check_not_input(output: str | os.PathLike, input_path: str | os.PathLike | None,
                    flags: tuple[str, str] = ("--output", "--input")) -> None:
    """Refuse an output that is the very file being read (the same path, or a link to it)."""
    if not input_path or input_path == "-" or is_special(output):
        return
    try:
        same = os.path.samefile(output, input_path)
    except OSError:  # one of them does not exist (yet): not the same file
        return
    if same:
        raise QkvError(f"{flags[0]} {output} is the same file as {flags[1]} {input_path}: "
                       f"write the output to another file")


@contextlib.contextmanager
def output_stream(path: str | None):
    """``--output FILE`` written all or nothing (:func:`qkv.files.atomic_output`), or stdout."""
    if not path:
        import sys

        yield sys.stdout
        return
    with atomic_output(path) as fh:
        yield fh


def sigterm_interrupts():
    """SIGTERM (``kill``, ``timeout``, a scheduler or service manager) and Ctrl-C raise KeyboardInterrupt
    within the block, as :func:`qkv.startup.interrupts` describes: temporary files are removed on the
    way out and the ``qkv`` command exits with status 130."""
    from qkv.startup import interrupts

    return interrupts()


def write_lines(path: str, lines: list[str]) -> None:
    """One line per item, all or nothing."""
    with atomic_output(path) as fh:
        fh.write("".join(line + "\n" for line in lines))


__all__ = ["output_stream", "write_lines", "atomic_output", "check_output_file", "check_output_dir", "check_not_input", "is_special",
           "os_error_message", "os_error_reason", "pid_alive", "remove_stale_temps", "sigterm_interrupts"]


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, as hex (read in blocks; the hash releases the GIL, so threads may
    digest several files at once)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


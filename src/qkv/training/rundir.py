"""A run directory (``qkv train --out DIR``): one writer at a time, and every crash point recoverable.

A run directory holds ``last/`` (the commit point of the run: resuming continues from it),
``best/``, the numbered ``step_N/`` checkpoints and ``metrics.jsonl``. Two things keep it whole:

* :class:`RunLock`: an OS file lock on ``DIR/.lock``, held for the whole run by the process that
  writes the directory. A second ``qkv train`` on the same directory fails at once, naming the
  holder's pid. The kernel releases the lock when the holder dies, even by ``kill -9``.
* :func:`recover`, called under the lock before a run starts: a checkpoint save killed between its
  two renames (see :func:`qkv.checkpoint.save_checkpoint`) is finished (the new copy is
  complete) or rolled back (the previous copy is put back), and temporary directories of saves
  that never completed are removed. ``metrics.jsonl`` is cut back to the step the run resumes
  from (:func:`truncate_metrics`), so a resumed run does not record the same steps twice.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from qkv.errors import QkvError
from qkv.checkpoint import MANIFEST, TRAINER_STATE, fsync_dir, is_complete
from qkv.data.binarized import is_corpus

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the run directory is not locked there
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
# what save_checkpoint leaves beside DIR/NAME while writing: .NAME.tmp-XXXX, and .NAME.tmp-XXXX.old
_TEMP = re.compile(r"\.(?P<name>.+)\.tmp-(?P<id>[^.]+)(?P<old>\.old)?")

_held: dict[Path, list] = {}  # run directory -> [open lock file, holders]: the lock is re-entrant in a process


class RunLock:
    """Hold an exclusive lock on ``run_dir`` (created if needed) for the ``with`` block.

    Re-entrant within one process (the CLI takes it before reading data, :func:`train` again);
    another process asking for it gets a :class:`QkvError` naming the holder's pid. A directory the
    lock created is removed again if nothing else was written to it (a start refused for bad input).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)

    def __enter__(self) -> "RunLock":
        created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QkvError(f"cannot create the run directory {self.run_dir}: {e.strerror or e}") from None
        key = self.run_dir.resolve()
        if key in _held:
            _held[key][1] += 1
            return self
        fh = open(key / LOCK_FILE, "a+", encoding="utf-8")
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    fh.close()
                    raise
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                fh.close()
                raise QkvError(f"{self.run_dir} is in use by another qkv process (pid {holder}); wait for it to "
                               f"finish or stop it, or choose another --out") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        _held[key] = [fh, 1, created]
        return self

    def __exit__(self, *exc) -> None:
        key = self.run_dir.resolve()
        entry = _held[key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            fh, _, created = entry
            if created and [p.name for p in key.iterdir()] == [LOCK_FILE]:  # a start that wrote nothing
                (key / LOCK_FILE).unlink()
                key.rmdir()
            fh.close()  # closing the file releases the lock


def recover(run_dir: str | os.PathLike, log: Callable[[str], None]) -> None:
    """Finish or roll back checkpoint saves that a crash cut short, and remove their leftovers.

    Call it while holding the :class:`RunLock`: then no save is in flight, and everything
    temporary belongs to a process that is gone.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    temps = [(p, m) for p in run_dir.iterdir() if (m := _TEMP.fullmatch(p.name)) and p.is_dir()]
    for old, m in [(p, m) for p, m in temps if m["old"]]:
        target = run_dir / m["name"]
        new = run_dir / f".{m['name']}.tmp-{m['id']}"
        if target.exists():  # the swap was done; only deleting the previous copy was left
            continue
        if new.is_dir() and is_complete(new):
            os.replace(new, target)
            log(f"recovered {target}: finished a save that was interrupted between its two renames")
        else:
            os.replace(old, target)
            log(f"recovered {target}: put the previous checkpoint back (its replacement was incomplete)")
        fsync_dir(run_dir)
    for p in run_dir.iterdir():
        if _TEMP.fullmatch(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)  # leftovers of saves that never completed, or done swaps
    fsync_dir(run_dir)


def is_locked(run_dir: str | os.PathLike) -> bool:
    """Whether a process holds the :class:`RunLock` of ``run_dir`` now (a run that is starting or
    training). A ``.lock`` file alone says nothing: other tools leave files of that name."""
    if fcntl is None:
        return False
    try:
        fh = open(Path(run_dir) / LOCK_FILE, encoding="utf-8")
    except OSError:
        return False
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a run holds it
        except OSError:
            return True
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return False


def is_run_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the directory of a training run (``qkv train --out``), running or not: a
    run holds its lock, or the directory has ``metrics.jsonl``, or a ``last/`` or ``best/`` with
    trainer state."""
    path = Path(path)
    return ((path / "metrics.jsonl").is_file() or is_locked(path)
            or any((path / name / TRAINER_STATE).is_file() for name in ("last", "best")))


def holds_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """Names of the checkpoints in ``run_dir`` (last, best, step_N), for refusing to start over them;
    a corpus from ``qkv preprocess`` kept there (its manifest says so) is not one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.is_dir() and (p / MANIFEST).is_file() and not is_corpus(p))


def missing_last_message(run_dir: str | os.PathLike) -> str:
    """Why ``--resume`` cannot continue ``run_dir``, and what to do, without advice that loses checkpoints."""
    run_dir = Path(run_dir)
    held = holds_checkpoints(run_dir)
    if held:
        return (f"cannot resume: {run_dir / 'last'} does not exist: the run stopped before its first checkpoint "
                f"was committed; {run_dir} holds {', '.join(held)} of that attempt. Start again with another --out "
                f"(or delete {run_dir} and train without --resume)")
    return f"cannot resume: {run_dir / 'last'} does not exist (train without --resume first)"


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Drop the records of ``metrics.jsonl`` after ``step`` (the step a run resumes from), atomically.

    A run killed after it logged steps beyond its last checkpoint logs them again when resumed;
    cutting them first keeps one record per step. A torn last line (a kill mid-write) goes too.
    Returns the number of records dropped.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            keep = int(record.get("step", 0)) <= step
        except (ValueError, TypeError, AttributeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    return dropped

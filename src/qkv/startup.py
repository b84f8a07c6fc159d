"""Ctrl-C and SIGTERM, from the first line of the ``qkv`` command to its last: exit status 130, never
a traceback, never a signal lost.

The ``qkv`` command (:func:`qkv.__main__.main`) calls :func:`install` before it imports anything
else, and :func:`finish` when the command is done; :func:`qkv.cli.main` runs each command inside
:func:`interrupts` (which installs the same handler when it is called in-process). The handler:

* turns SIGINT and SIGTERM into a KeyboardInterrupt, which the command's ``finally`` blocks and
  context managers answer (temporary files removed) and the CLI reports as ``interrupted``, 130;
* never raises inside an ``import`` (torch, numpy, transformers): an exception there leaves modules
  half-initialised (``cannot load module more than once``, a numpy without ``matrix``), and import
  machinery or a library's bare ``except`` can swallow it, so the command ran on to the end. A
  signal that comes during an import is held and raised as soon as the import is over (a SIGALRM
  timer looks again every 20 ms);
* raises once: a second signal while the command is stopping is ignored, so the clean-up runs to
  its end and the status stays 130. An interrupt that a library swallows, or turns into an error
  of its own (safetensors' Rust code does), is raised again after :data:`REPEAT_S` seconds, and
  the command's status is 130 whatever became of it (:func:`interrupted`);
* stays in place to the end: :func:`finish` ignores both signals once the command is done, so that
  one during the interpreter's shutdown cannot kill the process with 143.

Training and ``qkv serve`` put their own handlers in place while they run (training commits
``last/`` first; uvicorn lets the requests under way finish) and give the signal back to this one.

This module imports nothing but the standard library: it is in place before anything heavy.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
RETRY_S = 0.02  # how often a signal held during an import looks again whether the import is over
REPEAT_S = 1.0  # an interrupt not reported as such this long after it was raised is raised again

_IMPORT_CODE = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


class _State:
    held: int | None = None  # a signal that came during an import, not yet raised
    raised: int | None = None  # the signal whose KeyboardInterrupt was raised: the command is stopping
    reported = False  # the CLI reported the interruption (report_interrupted)
    done = False  # finish() was called: the command is over

    def reset(self) -> None:
        self.held, self.raised, self.reported, self.done = None, None, False, False


_state = _State()


def in_import(frame) -> bool:
    """Whether ``frame`` (the frame a signal handler was called in) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_CODE:
            return True
        frame = frame.f_back
    return False


def interrupted() -> bool:
    """Whether a signal interrupted the command (whatever became of its KeyboardInterrupt: a library
    may turn it into an error of its own, or swallow it)."""
    return _state.raised is not None or _state.held is not None


def _timer(seconds: float) -> None:
    if hasattr(signal, "setitimer"):
        signal.signal(signal.SIGALRM, _on_timer)
        signal.setitimer(signal.ITIMER_REAL, seconds)


def _stop_timer() -> None:
    """Cancel this module's SIGALRM timer (only its own: the timer is left alone if another set it)."""
    if _main_thread() and hasattr(signal, "setitimer") and signal.getsignal(signal.SIGALRM) is _on_timer:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _interrupt(signum: int) -> None:
    _state.held, _state.raised = None, signum
    _timer(REPEAT_S)  # should it be swallowed on its way, it comes again
    raise KeyboardInterrupt(f"signal {signum}")


def _on_signal(signum: int, frame) -> None:
    """The handler of SIGINT and SIGTERM."""
    if _state.done or _state.raised is not None:
        return  # already stopping: the clean-up runs to its end (and a lost interrupt comes again)
    if in_import(frame):
        _state.held = signum
        if hasattr(signal, "setitimer"):
            _timer(RETRY_S)
            return
    _interrupt(signum)


def _on_timer(signum: int, frame) -> None:
    """SIGALRM: raise a held signal once the import it came in is over; raise again an interrupt that
    was never reported (a library swallowed it); otherwise nothing."""
    pending = _state.held if _state.held is not None else _state.raised
    if pending is None or _state.done or _state.reported:
        return
    if in_import(frame):
        _timer(RETRY_S)
        return
    _interrupt(pending)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install() -> None:
    """Put the handler in place for SIGINT and SIGTERM, for the rest of the process (the ``qkv``
    command's first act). Only the main thread may; elsewhere nothing happens."""
    if not _main_thread():
        return
    _state.reset()
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def finish() -> None:
    """The command is over: both signals are ignored from now on (the interpreter's shutdown may
    take a while; a signal then must not turn status 130 or 0 into 143), and a held one is dropped."""
    _state.done = True
    if not _main_thread():
        return
    _stop_timer()
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise KeyboardInterrupt as described above; the handlers
    in place before are put back after it (for a caller that runs :func:`qkv.cli.main` in-process)."""
    if not _main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (*SIGNALS, signal.SIGALRM)} if hasattr(signal, "SIGALRM") \
        else {sig: signal.getsignal(sig) for sig in SIGNALS}
    nested = previous[SIGNALS[0]] is _on_signal  # under the qkv command: a signal held since start-up stays held
    if not nested:
        _state.reset()
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        if not nested:  # in-process: as it was before (another's timer, e.g. a test's timeout, left alone)
            _stop_timer()
            for sig, handler in previous.items():
                if sig in SIGNALS or signal.getsignal(sig) is _on_timer:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def command_name(argv: list[str]) -> str:
    """``qkv CMD`` for messages (``qkv`` when there is no command, or it is not valid text)."""
    first = next((a for a in argv if not a.startswith("-")), "")
    try:
        first.encode("utf-8")
    except UnicodeEncodeError:
        first = ""
    return f"qkv {first}".strip()


def report_interrupted(argv: list[str] | None = None) -> int:
    """``qkv CMD: interrupted`` on stderr; the exit status 130."""
    _state.reported = True
    _stop_timer()
    try:
        print(f"{command_name(sys.argv[1:] if argv is None else argv)}: interrupted", file=sys.stderr)
    except (OSError, ValueError):  # stderr closed
        pass
    return 130


__all__ = ["install", "finish", "interrupts", "interrupted", "in_import", "report_interrupted"]

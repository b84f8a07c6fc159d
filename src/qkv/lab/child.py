"""How the lab runs ``qkv train``: ``python -m qkv.lab.child FD ARGS...`` is ``qkv ARGS...`` that stops
when the lab's process ends, however it ends.

``FD`` is the read end of the lab's lifeline, a pipe whose write end the lab's process alone holds
(:class:`qkv.lab.runs.Lab`). Nothing is ever written to it: a read returns only when the write end is
closed, which the kernel does when the lab's process ends (Ctrl-C, SIGTERM, a crash, kill -9). The
run then gets SIGTERM, so the trainer commits ``last/`` at its next update and exits; a run that has
not exited ``GRACE`` seconds later (stuck before its first update) exits at once.

A pipe, not Linux's PR_SET_PDEATHSIG: that signal follows the *thread* that spawned the child, and the
lab's threads come and go (a thread pool retires its idle workers), which ended runs nobody stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE = 60.0  # seconds from the SIGTERM to a forced exit


def die_with_lab(fd: int, grace: float = GRACE) -> threading.Thread:
    """Watch the lifeline ``fd`` in a daemon thread: at its end of file, SIGTERM this process, and
    after ``grace`` seconds more exit outright."""

    def watch() -> None:
        try:
            while os.read(fd, 4096):  # nothing is written; b"" is the end: the lab's process is gone
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    thread = threading.Thread(target=watch, name="lab-lifeline", daemon=True)
    thread.start()
    return thread


def main() -> None:
    import runpy

    die_with_lab(int(sys.argv[1]))
    sys.argv = ["qkv", *sys.argv[2:]]
    runpy.run_module("qkv", run_name="__main__", alter_sys=True)  # as python -m qkv ARGS...


if __name__ == "__main__":
    main()

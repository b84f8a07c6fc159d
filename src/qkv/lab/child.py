"""How the lab runs ``qkv train``: ``python -m qkv.lab.child PARENT_PID ARGS...`` is ``qkv ARGS...``
that ends (SIGTERM: it saves ``last/`` first) when the lab's process ends, however it ends (Linux;
elsewhere the lab's own shutdown stops its runs)."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the parent process ends (Linux's PR_SET_PDEATHSIG); a parent
    already gone before the request counts as ended."""
    if sys.platform == "linux":
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    import runpy

    die_with_parent(int(sys.argv[1]))
    sys.argv = ["qkv", *sys.argv[2:]]
    runpy.run_module("qkv", run_name="__main__", alter_sys=True)  # as python -m qkv ARGS...


if __name__ == "__main__":
    main()

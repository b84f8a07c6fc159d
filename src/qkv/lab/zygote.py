"""A warm start for the lab's runs: one process that has imported torch and qkv's trainer forks each run.

A run started as a fresh ``python -m qkv.lab.child ... train`` spends most of its start-up importing:
torch, then ``torch._dynamo``, which torch imports the first time an optimizer is made. Those imports
are the same for every run, so the lab keeps one process that has done them (``python -m
qkv.lab.zygote FD``, started with the lab) and asks it for each run; the run is a ``fork`` of it, with
everything imported already, and begins reading its data at once.

The protocol, one JSON object a line: the lab writes ``{"argv", "env", "log"}`` to the zygote's
standard input; the zygote answers ``{"ready": true}`` once its imports are done, ``{"pid": N}`` for
each run it forked and ``{"exit": N, "code": C}`` when run N ends (``C`` as ``Popen.returncode``:
negative for a signal). A run is a session of its own (``setsid``), its output goes to ``log``, it
holds the lab's lifeline as a run started by :mod:`qkv.lab.child` does, and it ends like ``qkv
ARGS...`` would. The zygote runs no model: no thread pool of torch's has started when it forks.

:class:`Zygote` is the lab's side: :meth:`Zygote.spawn` returns a :class:`WarmRun`, which answers
``poll``, ``wait``, ``send_signal`` and ``kill`` as ``subprocess.Popen`` does. Where the zygote cannot
start or has died, the lab starts its runs cold, as before (:class:`qkv.lab.runs.Lab`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# what every run imports before its first update (torch._dynamo: the first optimizer's import)
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "qkv.cli", "qkv.training.trainer", "qkv.models",
           "qkv.data.corpus")
READY_TIMEOUT = 120.0  # seconds a run waits for a zygote still importing, before it starts cold


# --- the zygote's own process -------------------------------------------------------------------------


def _answer(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())  # one write: atomic on a pipe, no Python lock


def _reap(fd: int) -> None:
    """Every ended child, answered as ``{"exit": pid, "code": ...}`` (run from SIGCHLD)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer(fd, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _run(request: dict, lifeline: int) -> None:
    """In the forked child: become the run (a session of its own, output to its log) and never return."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        # fresh stream objects: a lock of the zygote's could have been held at the fork
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        from qkv.lab.child import die_with_lab

        die_with_lab(lifeline)
        sys.argv = ["qkv", *request["argv"]]
        import runpy

        runpy.run_module("qkv", run_name="__main__", alter_sys=True)  # as python -m qkv ARGV: ends in SystemExit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the run's own traceback goes to its log, as python -m qkv's would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code if isinstance(code, int) else 1)


def main() -> None:
    lifeline = int(sys.argv[1])
    answers = os.dup(1)
    from qkv.lab.child import die_with_lab

    die_with_lab(lifeline, grace=0.0)  # the lab gone: the zygote goes at once (its runs watch for themselves)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, lambda *_: _reap(answers))
    _answer(answers, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(request, lifeline)
        _answer(answers, {"pid": pid})
        _reap(answers)  # a run that ended before the handler was set for it
    # the lab closed its end: no more runs; stay until those running have ended, to say how they ended
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return
        _answer(answers, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# --- the lab's side -----------------------------------------------------------------------------------


class WarmRun:
    """A run forked by the zygote, with ``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, zygote: Zygote, pid: int, log: Path):
        self.zygote = zygote
        self.pid = pid
        self.log = Path(log)
        self.returncode: int | None = None
        self.args = ["qkv.lab.zygote", str(pid)]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        if self.returncode is None and self.zygote.orphaned(self.pid):
            # the zygote was killed and the run, no longer its child, has ended: nobody can tell its exit
            # status, so its log does (qkv train's last words when it ends well: "stopped: ...")
            try:
                said = self.log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
            except OSError:
                said = []
            self.returncode = 0 if any(line.startswith("stopped: ") for line in said) else 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            with self.zygote.changed:
                self.zygote.changed.wait(0.1)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The lab's zygote process (see the module's text): started at once, importing in the background."""

    def __init__(self, lifeline: int, env: dict[str, str] | None = None):
        env = dict(env if env is not None else os.environ)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # each run sets its own
        src = str(Path(__file__).resolve().parents[2])  # this qkv, as the cold start's child gets it
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "qkv.lab.zygote", str(lifeline)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     pass_fds=(lifeline,), start_new_session=True)
        self.ready = threading.Event()
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}
        self.pids: list[int] = []
        self._reader = threading.Thread(target=self._read, name="lab-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self.changed:
                if "exit" in message:
                    self.exits[message["exit"]] = message["code"]
                elif message.get("ready"):
                    self.ready.set()
                elif "pid" in message:
                    self.pids.append(message["pid"])
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: so are the answers about its runs
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        """Run ``pid``'s exit code as the zygote reported it; None while it runs or when nobody reported it."""
        with self.changed:
            return self.exits.get(pid)

    def orphaned(self, pid: int) -> bool:
        """The zygote is gone without reporting run ``pid``'s end, and the run has ended."""
        if self.alive() or self._reader.is_alive() or self.exit_code(pid) is not None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reaped by init once it ends; a zombie has ended
            return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
        except (OSError, IndexError):
            return False

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, wait: float = READY_TIMEOUT) -> WarmRun | None:
        """Fork ``qkv ARGV`` with ``env``, its output appended to ``log``; None if the zygote cannot (not
        ready within ``wait`` seconds, or gone): the caller starts the run cold."""
        if not self.alive() or not self.ready.wait(wait) or not self.alive():
            return None
        with self.changed:
            known = len(self.pids)
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        end = time.monotonic() + 10
        with self.changed:
            while len(self.pids) == known:
                if time.monotonic() > end or not self.alive():
                    return None
                self.changed.wait(0.1)
            return WarmRun(self, self.pids[known], log)

    def close(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    main()

"""Ctrl-C and SIGTERM at any moment of a command's start-up (:mod:`qkv.startup`): exit status 130,
``qkv CMD: interrupted`` and no traceback, nothing half-written, also for a second signal while the
command stops. Real processes (``python -m qkv``), since imports, signal handlers and the
interpreter's shutdown are the point.

Delays are counted from the moment the command's handlers are in place, which the test reads from
the kernel (``SigCgt`` in ``/proc/PID/status``: SIGTERM is caught by qkv alone). Before that moment
only the interpreter's own start-up runs (here 0.05 to 0.2 s, the ``site`` module and the
environment's ``.pth`` files), where no program's code can answer a signal: Python's defaults apply
there (docs/training.md, "Exit statuses").
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/PID/status (Linux)")

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
MT = FIXTURES / "translate-transformer"
EXPORT_FORMAT = "ctranslate2" if importlib.util.find_spec("ctranslate2") else \
    "hf" if importlib.util.find_spec("transformers") else None
DELAYS = [0.0, 0.05, 0.15, 0.3, 0.5, 0.75, 1.0]  # a signal held by an import costs the rest of it: a few seconds


def handlers_in_place(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM (which Python itself does not): qkv's handler is in place."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            mask = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """argv of a translate (3,000 lines), a training run (the embedded task, 100,000 steps) and an export,
    each still starting up or running a second after its handlers are in place; and what each must
    not leave behind."""
    d = tmp_path_factory.mktemp("signals")
    (d / "in.txt").write_text("red cat blue dog\n" * 3000, encoding="utf-8")
    out = {"translate": (["translate", str(MT), "--input", str(d / "in.txt"), "--output", str(d / "out.txt"),
                          "--threads", "1"], d / "out.txt"),
           "train": (["train", "--out", str(d / "run"), "--threads", "1", "--max-steps", "100000"], None)}
    if EXPORT_FORMAT:
        out["export"] = (["export", str(MT), "--format", EXPORT_FORMAT, "--out", str(d / "exported")], d / "exported")
    return d, out


def start(argv: list[str]) -> tuple[subprocess.Popen, float]:
    proc = subprocess.Popen([sys.executable, "-m", "qkv", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not handlers_in_place(proc.pid):
        assert proc.poll() is None, f"ended before its handlers were in place: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "the handlers were never put in place"
        time.sleep(0.001)
    return proc, time.monotonic()


def signalled(argv: list[str], delay: float, *sigs: signal.Signals, gap: float = 0.03) -> subprocess.Popen:
    """``python -m qkv ARGV``, sent ``sigs`` (``gap`` seconds apart) ``delay`` seconds after its handlers
    are in place."""
    proc, ready = start(argv)
    time.sleep(max(0.0, ready + delay - time.monotonic()))
    for k, sig in enumerate(sigs):
        if k:
            time.sleep(gap)
        if proc.poll() is None:
            proc.send_signal(sig)
    return proc


def check(name: str, proc: subprocess.Popen, what: str, leftover: Path | None) -> None:
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (what, proc.returncode, err)
    assert "Traceback" not in err and "Exception ignored" not in err, (what, err)
    assert err.strip().splitlines()[-1] == f"qkv {name}: interrupted", (what, err)
    if leftover is not None:  # nothing half-written: no output, no temporary beside it
        assert not any(p.name.startswith((leftover.name, f".{leftover.name}.")) for p in leftover.parent.iterdir()), \
            (what, sorted(p.name for p in leftover.parent.iterdir()))


def test_a_signal_at_any_moment_of_start_up_ends_with_130(commands):
    """A sweep of delays from 0 to 1 s after the handlers are in place (the imports of torch, numpy and
    the export packages, loading, the first batches), SIGINT and SIGTERM in turn, the commands run side
    by side: every one ends with 130, its message and no traceback, and leaves no output behind."""
    _, argvs = commands
    with ThreadPoolExecutor(len(argvs)) as pool:
        for i, delay in enumerate(DELAYS):
            sigs = {name: (signal.SIGINT, signal.SIGTERM)[(i + j) % 2] for j, name in enumerate(argvs)}
            running = {name: pool.submit(signalled, argv, delay, sigs[name]) for name, (argv, _) in argvs.items()}
            for name, proc in running.items():
                check(name, proc.result(), f"{name} {sigs[name].name} after {delay} s", argvs[name][1])


SIGNAL_IN_IMPORT = """\
import os, runpy, signal, sys
target, sig = sys.argv[1], getattr(signal, sys.argv[2])

class SignalWhenImported:  # the signal arrives as the import of target begins, inside the import machinery
    def find_spec(self, name, path=None, spec=None):
        if name == target:
            sys.meta_path.remove(self)
            print(f"sent {sig.name} as {name} was imported", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)
        return None

sys.meta_path.insert(0, SignalWhenImported())
sys.argv = ["qkv", *sys.argv[3:]]
runpy.run_module("qkv", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module, sig", [("numpy", "SIGTERM"), ("numpy", "SIGINT"), ("numpy.linalg", "SIGTERM"),
                                         ("torch._C", "SIGINT"), ("safetensors", "SIGTERM")])
def test_a_signal_during_an_import_is_neither_lost_nor_breaks_the_import(module, sig, commands):
    """A signal that arrives exactly as a module begins to import (numpy swallowed such an interrupt, and
    the translation ran on to exit status 0) is held until the import is over, then interrupts: 130."""
    d, argvs = commands
    argv, leftover = argvs["translate"]
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_IMPORT, module, sig, *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert f"sent {sig} as {module} was imported" in proc.stderr, proc.stderr
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1] == "qkv translate: interrupted"
    assert not leftover.exists()


@pytest.mark.parametrize("delay", [0.05, 0.5, 2.0])
def test_a_second_signal_while_stopping_keeps_130(commands, delay):
    """SIGTERM, then SIGTERM (or Ctrl-C) again 30 ms later, while the command stops: still 130 (not 143,
    the second signal's own death), one message, no traceback."""
    _, argvs = commands
    with ThreadPoolExecutor(len(argvs)) as pool:
        running = {name: pool.submit(signalled, argv, delay, signal.SIGTERM, (signal.SIGTERM, signal.SIGINT)[k % 2])
                   for k, (name, (argv, _)) in enumerate(argvs.items())}
        for name, proc in running.items():
            check(name, proc.result(), f"{name}: two signals after {delay} s", argvs[name][1])

"""One ``ctranslate2.Translator`` in a process of its own (the CTranslate2 engine's worker).

Why a process per translator: CTranslate2's CPU kernels run on its own copy of GNU OpenMP
(libgomp), and libgomp decides how its idle threads wait from the threads of the whole process:
while a process holds more OpenMP threads than the machine has cores (two 2-thread translators on
2 cores), every idle thread sleeps at once instead of spinning briefly, and each of the thousands
of small parallel regions of a decoding step then waits for threads to wake. Two 2-thread
translators in one process decoded 14-17 times slower than one; one translator per process keeps
each at its speed alone. Setting ``OMP_WAIT_POLICY`` from Python does not help: its value is read
once, when the library loads, and after ``import torch`` the setting no longer reaches
CTranslate2's copy.

The parent (:class:`TranslatorProcess`) starts ``python ct2_worker.py`` (this file as a script: no
torch, no qkv package, so it starts in a fraction of a second) and speaks pickled tuples over the
worker's stdin and stdout::

    parent -> ("init", {Translator keyword arguments})        worker -> ("ok", {"pid": ...})
    parent -> (method, args, kwargs)                           worker -> ("ok", plain results)
                                                                          | ("error", (type name, message))

``method`` is ``translate_batch``, ``score_batch`` or ``idle_cpu`` (the CPU time the worker's process
spends while its one Python thread sleeps: the OpenMP threads' spinning, a diagnostic). Results
cross as plain lists and dicts and come back as objects with the attributes of CTranslate2's
results that qkv reads (``hypotheses``, ``scores``, ``attention``; ``tokens``, ``log_probs``).

The worker ends with its parent: when the pipe closes (the parent exited, was killed, or closed
the translator), and, for a call still running when that happens, when its parent process id
changes. It ignores SIGINT: a Ctrl-C reaches the whole process group, and the parent, which
handles it, closes the pipe.
"""

import sys

if __name__ == "__main__":  # run as a script: its own folder (qkv/export) must not shadow a module
    del sys.path[0]

import builtins
import os
import pickle
import signal
import subprocess
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

WORKER = Path(__file__).resolve()
FIELDS = {"translate_batch": ("hypotheses", "scores", "attention"), "score_batch": ("tokens", "log_probs")}


# --- the worker (this file run as a script) --------------------------------------------------------------

def _plain(method: str, results) -> list[dict]:
    return [{name: getattr(r, name) for name in FIELDS[method]} for r in results]


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve_forever() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the replies
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    def reply(status: str, value) -> None:
        pickle.dump((status, value), replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()

    try:
        _, kwargs = pickle.load(requests)
        import ctranslate2

        translator = ctranslate2.Translator(**kwargs)
    except EOFError:
        return
    except Exception as e:  # noqa: BLE001 - every failure goes back to the parent by name
        reply("error", (type(e).__name__, str(e)))
        return
    reply("ok", {"pid": os.getpid(), "ctranslate2": ctranslate2.__version__})
    while True:
        try:
            method, args, kwargs = pickle.load(requests)
        except (EOFError, pickle.UnpicklingError):
            return
        try:
            if method == "idle_cpu":
                start = time.process_time()
                time.sleep(float(args[0]))
                value = time.process_time() - start
            elif method in FIELDS:
                value = _plain(method, getattr(translator, method)(*args, **kwargs))
            else:
                raise ValueError(f"unknown method {method!r}")
        except Exception as e:  # noqa: BLE001
            reply("error", (type(e).__name__, str(e)))
        else:
            try:
                reply("ok", value)
            except BrokenPipeError:
                return


# --- the parent's side ---------------------------------------------------------------------------------

if __name__ == "__main__":
    _Error = RuntimeError
else:
    from qkv.errors import QkvError as _Error


class WorkerError(_Error):
    """The worker process ended or stopped answering."""


def _close(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Cores:
    """The cores of the machine shared by the workers of one program: a call takes as many as its
    translator has threads and waits while they are taken. Two 2-thread translators decoding at
    once on 2 cores put 4 spinning OpenMP threads on 2 cores, and each waited on the other's
    threads at every parallel region: together they answered about a tenth of what one answered
    alone. Taking turns, they share the machine's throughput instead."""

    def __init__(self, total: int):
        self.total, self.free = total, total
        self.cond = threading.Condition()

    def take(self, n: int) -> int:
        n = max(1, min(n, self.total))
        with self.cond:
            self.cond.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    def give(self, n: int) -> None:
        with self.cond:
            self.free += n
            self.cond.notify_all()


CORES = Cores(cores())


class TranslatorProcess:
    """``ctranslate2.Translator(**kwargs)`` living in a worker process of its own: the methods qkv calls
    (``translate_batch``, ``score_batch``) with CTranslate2's arguments, one call at a time (a lock:
    the translator decodes one batch at a time anyway), each call holding as many of the program's
    cores as the translator has threads (:class:`Cores`; ``intra_threads`` 0, CTranslate2's default,
    counts as every core). ``name`` appears in errors (the model)."""

    def __init__(self, name: str, **kwargs):
        self.name = name
        self.lock = threading.Lock()
        self.threads = int(kwargs.get("intra_threads") or 0) or CORES.total
        self.calls = dict.fromkeys(FIELDS, 0)  # calls made so far, per method (what benchmarks and tests count)
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     close_fds=True)
        self._finalizer = weakref.finalize(self, _close, self.proc)
        try:
            info = self._call("init", **kwargs)
        except BaseException:
            self.close()
            raise
        self.pid = info["pid"]

    def _call(self, method: str, *args, **kwargs):
        message = (method, kwargs) if method == "init" else (method, args, kwargs)
        with self.lock:
            taken = CORES.take(self.threads) if method in FIELDS else 0
            if method in FIELDS:
                self.calls[method] += 1
            try:
                pickle.dump(message, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.flush()
                status, value = pickle.load(self.proc.stdout)
            except (BrokenPipeError, EOFError, OSError, ValueError, pickle.UnpicklingError):
                code = self.proc.poll()
                ended = f"ended (exit status {code})" if code is not None else "stopped answering"
                raise WorkerError(f"the CTranslate2 worker process of {self.name} {ended}") from None
            finally:
                if taken:
                    CORES.give(taken)
        if status == "error":
            kind, text = value
            error = getattr(builtins, kind, None)
            if not (isinstance(error, type) and issubclass(error, Exception)):
                error = RuntimeError
            raise error(text)
        return value

    def translate_batch(self, *args, **kwargs) -> list[SimpleNamespace]:
        return [SimpleNamespace(**r) for r in self._call("translate_batch", *args, **kwargs)]

    def score_batch(self, *args, **kwargs) -> list[SimpleNamespace]:
        return [SimpleNamespace(**r) for r in self._call("score_batch", *args, **kwargs)]

    def idle_cpu(self, seconds: float) -> float:
        """CPU seconds the worker's process uses while it sleeps ``seconds``: its OpenMP threads'
        spinning after the last call (a diagnostic of how its threads wait)."""
        return float(self._call("idle_cpu", seconds))

    def close(self) -> None:
        """End the worker (it also ends when this object is collected or the program exits)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


if __name__ == "__main__":
    serve_forever()

"""One ``ctranslate2.Translator`` in a process of its own (the CTranslate2 engine's worker), and its
supervision: a worker that dies or stops answering is replaced.

Why a process per translator: CTranslate2's CPU kernels run on its own copy of GNU OpenMP
(libgomp), and libgomp decides how its idle threads wait from the threads of the whole process:
while a process holds more OpenMP threads than the machine has cores (two 2-thread translators on
2 cores), every idle thread sleeps at once instead of spinning briefly, and each of the thousands
of small parallel regions of a decoding step then waits for threads to wake. Two 2-thread
translators in one process decoded 14-17 times slower than one; one translator per process keeps
each at its speed alone. Setting ``OMP_WAIT_POLICY`` from Python does not help: its value is read
once, when the library loads, and after ``import torch`` the setting no longer reaches
CTranslate2's copy.

The parent (:class:`TranslatorProcess`) starts ``python worker.py`` (this file as a script: no
torch, no qkv package, so it starts in a fraction of a second) and speaks pickled tuples over the
worker's stdin and stdout, each message an 8-byte length and its pickle (so that the parent reads
and writes with a deadline, never blocked by a worker that stopped halfway)::

    parent -> ("init", {Translator keyword arguments})        worker -> ("ok", {"pid": ...})
    parent -> (method, args, kwargs)                           worker -> ("ok", plain results)
                                                                          | ("error", (type name, message))

``method`` is ``translate_batch``, ``score_batch`` or ``idle_cpu`` (the CPU time the worker's process
spends while its one Python thread sleeps: the OpenMP threads' spinning, a diagnostic). Results
cross as plain lists and dicts and come back as objects with the attributes of CTranslate2's
results that qkv reads (``hypotheses``, ``scores``, ``attention``; ``tokens``, ``log_probs``).

Supervision (all of it in :class:`TranslatorProcess`): a worker that ends (killed, crashed) is
replaced at once, by a thread that waits on it, and a call it was answering fails with
:class:`WorkerError` (``retry_after`` seconds: HTTP 503 in ``qkv serve``); a call that gets no answer
within ``timeout`` seconds kills its worker, which is replaced, and fails the same way. Starts are
retried with back-off (:data:`START_TRIES`, from :data:`BACKOFF_S` doubling); a worker that cannot be
started that many times in a row is ``failed``, and calls fail at once until :data:`COOLDOWN_S` has
passed, when the next call tries again. A call holds the cores of the program (:class:`Cores`) only
while its worker uses them: a worker that has used no CPU for :data:`IDLE_S` (stopped, or hung)
gives them back, so that other models' calls never wait on it.

The worker ends with its parent: when the pipe closes (the parent exited, was killed, or closed
the translator), and, for a call still running when that happens, when its parent process id
changes. It ignores SIGINT: a Ctrl-C reaches the whole process group, and the parent, which
handles it, closes the pipe.
"""

import sys

if __name__ == "__main__":  # run as a script: its own folder (qkv/engines) must not shadow a module
    del sys.path[0]

import builtins
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

WORKER = Path(__file__).resolve()
FIELDS = {"translate_batch": ("hypotheses", "scores", "attention"), "score_batch": ("tokens", "log_probs")}
HEADER = struct.Struct("<Q")  # a message: its length, then its pickle


# --- messages --------------------------------------------------------------------------------------------

def _pack(value) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _read_exact(fd: int, n: int, deadline: float | None = None, on_wait=None, poller=None) -> bytes:
    """``n`` bytes from ``fd``: blocking where ``deadline`` is None (the worker), else by ``deadline``
    (``time.monotonic()``; TimeoutError after it) on a non-blocking ``fd`` that ``poller``
    (``select.poll``) watches for input, calling ``on_wait()`` at least every :data:`POLL_S` while
    nothing comes. EOFError where the pipe closes first."""
    chunks, got = [], 0
    while got < n:
        try:
            chunk = os.read(fd, min(n - got, 1 << 20))
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError from None
            if not poller.poll(1000 * (min(left, POLL_S) if on_wait else left)) and on_wait:
                on_wait()
            continue
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes, deadline: float | None = None, poller=None) -> None:
    """All of ``data`` to ``fd``: blocking where ``deadline`` is None, else by ``deadline`` (TimeoutError
    after it) on a non-blocking ``fd`` that ``poller`` watches for room."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError from None
            poller.poll(1000 * left)


def _receive(fd: int, deadline: float | None = None, on_wait=None, poller=None):
    (size,) = HEADER.unpack(_read_exact(fd, HEADER.size, deadline, on_wait, poller))
    return pickle.loads(_read_exact(fd, size, deadline, on_wait, poller))


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
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the replies
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    def reply(status: str, value) -> None:
        _write_all(replies, _pack((status, value)))

    try:
        _, kwargs = _receive(requests)
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
            method, args, kwargs = _receive(requests)
        except (EOFError, OSError, pickle.UnpicklingError):
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
    from qkv.errors import Unavailable as _Error

TIMEOUT_S = 600.0  # a call unanswered this long kills its worker (default; --engine-timeout)
START_TIMEOUT_S = 120.0  # a worker that has not loaded its model this long after it started counts as failed
START_TRIES = 4  # starts in a row before a worker counts as failed
BACKOFF_S = 0.25  # the wait before the second of those starts, doubled before each further one
COOLDOWN_S = 30.0  # a failed worker's calls fail at once this long; then the next call tries again
IDLE_S = 0.5  # a call whose worker has used no CPU this long gives back the cores it holds
POLL_S = 0.1  # how often a call holding cores looks at its worker's CPU time


class WorkerError(_Error):
    """The worker process ended, stopped answering or could not be started: a failure of the engine,
    not of the request (``qkv serve`` answers 503 with ``Retry-After: retry_after``)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


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


def _close_live(live: dict) -> None:
    """Mark the translator closed (its workers' watchers then start no other) and end its current
    worker, ``live["procs"]`` (shared with the translator, so that a replaced worker is the one its
    finalizer ends, also at the program's exit)."""
    live["closed"] = True
    for proc in live["procs"]:
        _close(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()  # SIGKILL ends a stopped process too
    except OSError:
        pass
    _close(proc)


def cpu_state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and CPU time (clock ticks, all its threads), from ``/proc`` (None
    where there is no ``/proc``, or the process is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class IdleProbe:
    """Whether a worker has used no CPU for ``idle_s`` seconds (or is stopped): read from its CPU time."""

    def __init__(self, pid: int, idle_s: float = IDLE_S):
        self.pid, self.idle_s = pid, idle_s
        self.ticks, self.since = None, time.monotonic()

    def idle(self) -> bool:
        state = cpu_state(self.pid)
        if state is None:
            return False
        letter, ticks = state
        if letter in "tT":  # stopped (SIGSTOP, a debugger)
            return True
        now = time.monotonic()
        if ticks != self.ticks:
            self.ticks, self.since = ticks, now
            return False
        return now - self.since >= self.idle_s


def _watch(ref: "weakref.ref[TranslatorProcess]", proc: subprocess.Popen) -> None:
    """Wait for ``proc`` to end (without reaping it: the translator reads its exit status), then have
    its translator replace it where it is still the current worker."""
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass  # already reaped (a call read its exit status first): it has ended all the same
    except (OSError, AttributeError):  # no waitid here: a worker that ends is replaced at the next call
        return
    translator = ref()
    if translator is not None:
        translator._heal(proc)


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
    """``ctranslate2.Translator(**kwargs)`` living in a worker process of its own, supervised: the
    methods qkv calls (``translate_batch``, ``score_batch``) with CTranslate2's arguments, one call at
    a time (a lock: the translator decodes one batch at a time anyway), each call holding as many of
    the program's cores as the translator has threads (:class:`Cores`; ``intra_threads`` 0,
    CTranslate2's default, counts as every core) while its worker uses them. ``name`` appears in
    errors (the model); ``timeout``: the seconds a call may go unanswered before its worker is killed
    and replaced. What happens when a worker ends or stops answering: the module's docstring.

    ``state``: ``ready`` (a worker is loaded and answers), ``restarting`` (one is being started in
    place of one that ended or stopped answering), ``down`` (none runs; the next call starts one) or
    ``failed`` (none could be started: calls fail until :data:`COOLDOWN_S` has passed)."""

    def __init__(self, name: str, timeout: float = TIMEOUT_S, **kwargs):
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.name, self.timeout, self.kwargs = name, float(timeout), kwargs
        self.lock = threading.Lock()
        self.threads = int(kwargs.get("intra_threads") or 0) or CORES.total
        self.calls = dict.fromkeys(FIELDS, 0)  # calls made so far, per method (what benchmarks and tests count)
        self.restarts = 0  # workers started in place of one that ended or stopped answering
        self.state, self.problem, self.failed_until = "starting", None, 0.0
        self.proc: subprocess.Popen | None = None
        self._live = {"procs": [], "closed": False}  # the current worker, ended by the finalizer
        self._finalizer = weakref.finalize(self, _close_live, self._live)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # --- the worker's life ------------------------------------------------------------------------------

    def _start(self) -> None:
        """Start a worker and load the model in it; what loading raised is raised here."""
        proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                bufsize=0, close_fds=True)
        self.proc, self._live["procs"] = proc, [proc]
        self._pollers = {}
        for stream, event in ((proc.stdin, select.POLLOUT), (proc.stdout, select.POLLIN)):
            os.set_blocking(stream.fileno(), False)
            self._pollers[stream.fileno()] = poller = select.poll()
            poller.register(stream.fileno(), event)
        try:
            status, value = self._exchange(proc, ("init", self.kwargs), time.monotonic() + START_TIMEOUT_S)
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            why = self._ended(proc, isinstance(e, TimeoutError), START_TIMEOUT_S)
            _kill(proc)
            raise WorkerError(f"the CTranslate2 worker process of {self.name} {why} while loading the model") from None
        except BaseException:
            _kill(proc)
            raise
        if status == "error":
            _kill(proc)
            raise self._error(value)
        self.pid, self.state = value["pid"], "ready"
        threading.Thread(target=_watch, args=(weakref.ref(self), proc), daemon=True,
                         name=f"qkv-ct2-watch-{proc.pid}").start()

    def _restart(self) -> None:
        """Start a worker in place of the last one (ended or killed): up to :data:`START_TRIES` starts,
        with back-off; after that the translator is ``failed`` (WorkerError)."""
        self.state, last = "restarting", None
        for attempt in range(START_TRIES):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            if self.closed:
                break
            try:
                self._start()
            except Exception as e:  # noqa: BLE001 - tried again, then said
                last = e
                continue
            self.restarts += 1
            return
        if self.closed:
            raise WorkerError(f"the CTranslate2 translator of {self.name} is closed")
        self.state, self.failed_until = "failed", time.monotonic() + COOLDOWN_S
        self.problem = f"no worker could be started ({START_TRIES} tries; the last: {last})"
        raise WorkerError(f"the CTranslate2 worker process of {self.name}: {self.problem}", retry_after=COOLDOWN_S)

    def _replace(self, proc: subprocess.Popen, why: str) -> None:
        """Kill ``proc`` (the current worker, which ended or did not answer: ``why``) and start another."""
        _kill(proc)
        self.problem = f"the worker {why}"
        self._restart()

    def _heal(self, proc: subprocess.Popen) -> None:
        """``proc`` ended (its watcher's call): replaced where it is still the current, ready worker (a
        call it was answering replaces it itself)."""
        with self.lock:
            if self.closed or self.proc is not proc or self.state != "ready":
                return
            try:
                self._replace(proc, self._ended(proc, False))
            except WorkerError:
                pass  # failed: its state says so, and the next call after the cool-down tries again

    def _ensure(self) -> None:
        """A worker ready for a call: started where the last one ended (or none could be started and the
        cool-down has passed); WorkerError where none can answer."""
        if self.closed:
            raise WorkerError(f"the CTranslate2 translator of {self.name} is closed")
        if self.state == "failed":
            left = self.failed_until - time.monotonic()
            if left > 0:
                raise WorkerError(f"the CTranslate2 worker process of {self.name}: {self.problem}; the next try "
                                  f"in {math.ceil(left)} s", retry_after=left)
        elif self.state == "ready" and self.proc.poll() is not None:  # ended while idle, its watcher not yet run
            _kill(self.proc)
            self.problem = f"the worker {self._ended(self.proc, False)}"
        elif self.state == "ready":
            return
        self._restart()

    def _ended(self, proc: subprocess.Popen, timed_out: bool, timeout: float | None = None) -> str:
        if timed_out:
            return f"did not answer within {timeout or self.timeout:g} s"
        try:
            code = proc.wait(timeout=2)  # the pipe closes a moment before the exit status is there
        except subprocess.TimeoutExpired:
            code = None
        return f"ended (exit status {code})" if code is not None else "closed its pipe"

    # --- calls ---------------------------------------------------------------------------------------

    def _exchange(self, proc: subprocess.Popen, message, deadline: float, on_wait=None):
        stdin, stdout = proc.stdin.fileno(), proc.stdout.fileno()
        _write_all(stdin, _pack(message), deadline, self._pollers[stdin])
        return _receive(stdout, deadline, on_wait, self._pollers[stdout])

    @staticmethod
    def _error(value) -> Exception:
        kind, text = value
        error = getattr(builtins, kind, None)
        if not (isinstance(error, type) and issubclass(error, Exception)):
            error = RuntimeError
        return error(text)

    def _call(self, method: str, *args, **kwargs):
        with self.lock:
            self._ensure()
            proc = self.proc
            if method in FIELDS:
                self.calls[method] += 1
            taken = [CORES.take(self.threads) if method in FIELDS else 0]
            probe = IdleProbe(proc.pid)

            def on_wait() -> None:  # a worker that stopped using the CPU gives back its cores
                if taken[0] and probe.idle():
                    CORES.give(taken[0])
                    taken[0] = 0

            failure = None
            try:
                status, value = self._exchange(proc, (method, args, kwargs), time.monotonic() + self.timeout, on_wait)
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                failure = e
            except BaseException:  # (Ctrl-C): the pipe may hold half a message; the next call starts anew
                _kill(proc)
                self.state, self.problem = "down", "a call was interrupted"
                raise
            finally:
                if taken[0]:
                    CORES.give(taken[0])
            if failure is not None:
                timed_out = isinstance(failure, TimeoutError)
                why = self._ended(proc, timed_out)
                said = (f"the CTranslate2 worker process of {self.name} "
                        + (f"did not answer this call within {self.timeout:g} s and was killed" if timed_out
                           else f"{why} during this call"))
                try:
                    self._replace(proc, why)
                except WorkerError as e:
                    raise WorkerError(f"{said}; {self.problem}", retry_after=e.retry_after) from None
                raise WorkerError(f"{said}; another worker has been started: try again") from None
        if status == "error":
            raise self._error(value)
        return value

    def translate_batch(self, *args, **kwargs) -> list[SimpleNamespace]:
        return [SimpleNamespace(**r) for r in self._call("translate_batch", *args, **kwargs)]

    def score_batch(self, *args, **kwargs) -> list[SimpleNamespace]:
        return [SimpleNamespace(**r) for r in self._call("score_batch", *args, **kwargs)]

    def idle_cpu(self, seconds: float) -> float:
        """CPU seconds the worker's process uses while it sleeps ``seconds``: its OpenMP threads'
        spinning after the last call (a diagnostic of how its threads wait)."""
        return float(self._call("idle_cpu", seconds))

    def status(self) -> dict:
        """The translator's ``state`` (a worker that has ended and is not yet replaced: ``down``), the
        workers started in place of others (``restarts``), the current worker's ``pid``, and why the
        last one was replaced (``problem``); never blocks on a call."""
        state = self.state
        if state == "ready" and self.proc.poll() is not None:
            state = "down"
        out = {"state": state, "restarts": self.restarts, "pid": getattr(self, "pid", None)}
        if self.problem:
            out["problem"] = self.problem
        if state == "failed":
            out["retry_after"] = max(math.ceil(self.failed_until - time.monotonic()), 1)
        return out

    def close(self) -> None:
        """End the worker (it also ends when this object is collected or the program exits)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._live["closed"]

    @property
    def alive(self) -> bool:
        return self.state == "ready" and self.proc is not None and self.proc.poll() is None


if __name__ == "__main__":
    serve_forever()

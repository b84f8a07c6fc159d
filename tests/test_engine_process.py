"""The CTranslate2 engine runs each translator in a worker process of its own (qkv.engines.worker).

Why: CTranslate2's OpenMP library (libgomp) makes every idle thread of a process sleep at once, not
spin briefly, while the process holds more OpenMP threads than the machine has cores; two 2-thread
translators in one process then decoded 14-17x slower than one. The probe below reads that rule
directly, without timing: the CPU time a translator's process burns while it sleeps after a call
(its threads' spinning) stays the same when a second translator is loaded beside it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import qkv
from qkv.engines import cache
from qkv.engines import translator as engine
from qkv.engines.worker import TranslatorProcess, WorkerError
from qkv.export.optional import INSTALL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                                reason=f"ctranslate2 is not installed: {INSTALL}")

TRAINED = Path(__file__).parent / "fixtures" / "default-task"  # number words -> German
NUMBERS = ["three hundred twenty-one", "seven", "forty-two", "eleven hundred", "six hundred six", "twelve"]
SRC = str(Path(__file__).parents[1] / "src")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-process")
    shutil.copytree(TRAINED, root / "trained")
    cache.converted(root / "trained", log=lambda _: None)
    return root / "trained"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by its parent) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_each_translator_runs_in_its_own_process_with_the_outputs_of_ctranslate2_itself(ckpt):
    import ctranslate2

    a = qkv.load(ckpt, engine="ctranslate2", threads=1)
    b = qkv.load(ckpt, engine="ctranslate2", threads=1)
    assert len({a.ct2.pid, b.ct2.pid, os.getpid()}) == 3
    assert a.ct2.alive and b.ct2.alive
    pieces = [a.pieces(ids) for ids in a.tokenizers.src.encode(NUMBERS)]
    raw = ctranslate2.Translator(str(cache.converted(ckpt)), intra_threads=1)
    for options in ({"beam_size": 1}, {"beam_size": 4, "num_hypotheses": 2, "return_scores": True},
                    {"beam_size": 1, "return_attention": True}):
        want = raw.translate_batch(pieces, max_decoding_length=40, **options)
        got = a.ct2.translate_batch(pieces, max_decoding_length=40, **options)
        assert [r.hypotheses for r in got] == [r.hypotheses for r in want]
        assert [r.scores for r in got] == [r.scores for r in want]
        assert [r.attention for r in got] == [r.attention for r in want]
    targets = [h[0] for h in (r.hypotheses for r in raw.translate_batch(pieces, beam_size=1))]
    want = raw.score_batch(pieces, targets)
    got = b.ct2.score_batch(pieces, targets)
    assert [r.log_probs for r in got] == [r.log_probs for r in want]
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert a.translate(NUMBERS, beam_size=1) == b.translate(NUMBERS, beam_size=1)
    a.ct2.close(), b.ct2.close()
    assert not a.ct2.alive and not b.ct2.alive


def test_a_second_translator_leaves_the_first_ones_threads_waiting_as_they_did_alone(ckpt):
    """The probe of the module's docstring. Two threads each: on a machine with more than 3 cores
    libgomp never changes how threads wait, and the test holds trivially."""
    first = qkv.load(ckpt, engine="ctranslate2", threads=2)

    def spin() -> float:
        runs = []
        for _ in range(3):
            first.translate(NUMBERS, beam_size=1)
            runs.append(first.ct2.idle_cpu(0.3))
        return max(runs)

    alone = spin()
    if alone < 0.0005:
        pytest.skip(f"this machine's OpenMP threads do not spin after a call ({alone * 1000:.2f} ms): nothing to compare")
    second = qkv.load(ckpt, engine="ctranslate2", threads=2)
    second.translate(NUMBERS, beam_size=1)
    beside = spin()
    assert beside > alone / 4, (alone, beside)  # in one process: 0 (every idle thread asleep at once)


def test_the_engine_sets_no_openmp_wait_policy():
    """Setting OMP_WAIT_POLICY from Python never reached CTranslate2's OpenMP once torch was imported,
    and where it did (from the shell), PASSIVE made 2-thread decoding about 20x slower."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = SRC
    code = ("import os; from qkv.engines.translator import require_ctranslate2; require_ctranslate2(); "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"


def wait_for(condition, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def in_thread(fn):
    """``fn()`` on a thread of its own: (the thread, a dict that gets its ``result`` or ``error``)."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out["error"] = e
        out["at"] = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_worker_killed_while_idle_is_replaced_and_the_next_call_answered(ckpt):
    model = qkv.load(ckpt, engine="ctranslate2", threads=1)
    want = model.translate(NUMBERS, beam_size=1)
    first = model.ct2.pid
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: model.ct2.restarts == 1)  # replaced by its watcher, with no call to notice
    assert model.ct2.status()["state"] == "ready" and model.ct2.pid != first and alive(model.ct2.pid)
    assert model.ct2.status()["problem"] == "the worker ended (exit status -9)"
    assert model.translate(NUMBERS, beam_size=1) == want


def test_a_call_whose_worker_dies_fails_by_name_and_the_next_is_answered(ckpt):
    model = qkv.load(ckpt, engine="ctranslate2", threads=1)
    want = model.translate(NUMBERS, beam_size=1)
    first = model.ct2.pid
    os.kill(first, signal.SIGSTOP)  # so that the call is in flight when the worker dies
    thread, out = in_thread(lambda: model.translate(NUMBERS, beam_size=1))
    time.sleep(0.5)
    os.kill(first, signal.SIGKILL)
    thread.join(30)
    error = out.get("error")
    assert isinstance(error, WorkerError) and isinstance(error, qkv.errors.Unavailable), out
    assert re.fullmatch(rf"the CTranslate2 worker process of {re.escape(str(ckpt))} ended \(exit status -9\) during "
                        r"this call; another worker has been started: try again", str(error)), error
    assert error.retry_after == 1.0 and model.ct2.restarts == 1 and model.ct2.pid != first
    assert model.translate(NUMBERS, beam_size=1) == want


def test_an_unanswered_call_times_out_frees_the_cores_at_once_and_its_worker_is_replaced(ckpt):
    """Two translators that each take every core (threads 0): with the first one's worker stopped
    (SIGSTOP) during a call, the second one's call is answered at once, not after the first call's
    bound; the first call fails when its bound has passed and its worker is replaced."""
    from qkv.engines.worker import CORES

    stopped = qkv.load(ckpt, engine="ctranslate2", threads=0, engine_timeout=8)
    other = qkv.load(ckpt, engine="ctranslate2", threads=0)
    assert stopped.ct2.threads == other.ct2.threads == CORES.total and stopped.ct2.timeout == 8
    want = stopped.translate(NUMBERS, beam_size=1)
    first = stopped.ct2.pid
    os.kill(first, signal.SIGSTOP)
    start = time.monotonic()
    thread, out = in_thread(lambda: stopped.translate(NUMBERS, beam_size=1))
    time.sleep(0.2)  # the stopped call has taken the cores
    assert other.translate(NUMBERS, beam_size=1) == want
    answered = time.monotonic() - start
    thread.join(30)
    assert answered < 7 and not thread.is_alive(), answered  # before the stopped call's bound
    error = out.get("error")
    assert isinstance(error, WorkerError) and "did not answer this call within 8 s and was killed" in str(error), out
    assert 8 <= out["at"] - start < 20
    assert not alive(first) and stopped.ct2.pid != first and stopped.ct2.restarts == 1
    assert stopped.ct2.status()["problem"] == "the worker did not answer within 8 s"
    assert CORES.free == CORES.total  # every core given back
    assert stopped.translate(NUMBERS, beam_size=1) == want


def test_a_closed_translator_starts_no_other_worker(ckpt):
    model = qkv.load(ckpt, engine="ctranslate2", threads=1)
    worker = model.ct2.pid
    model.ct2.close()
    assert wait_for(lambda: not alive(worker))
    time.sleep(1.0)  # its watcher has seen it end
    assert model.ct2.restarts == 0 and model.ct2.proc.pid == worker
    with pytest.raises(WorkerError, match="is closed"):
        model.translate(["seven"], beam_size=1)


def test_a_worker_that_cannot_be_started_again_fails_then_is_tried_again(ckpt, monkeypatch):
    """Starts are retried with back-off, a bounded number of times; then calls fail at once (with the
    seconds to wait) until the cool-down has passed, and the next call starts a worker."""
    from qkv.engines import worker as ct2_worker

    monkeypatch.setattr(ct2_worker, "BACKOFF_S", 0.01)
    model = qkv.load(ckpt, engine="ctranslate2", threads=1)
    starts = []
    real = model.ct2._start
    monkeypatch.setattr(model.ct2, "_start", lambda: (starts.append(1), real())[1])
    good = model.ct2.kwargs["model_path"]
    model.ct2.kwargs["model_path"] = str(ckpt / "nowhere")  # as if the conversion had gone
    os.kill(model.ct2.pid, signal.SIGKILL)
    assert wait_for(lambda: model.ct2.state == "failed")
    assert len(starts) == ct2_worker.START_TRIES
    status = model.ct2.status()
    assert status["retry_after"] == ct2_worker.COOLDOWN_S and "4 tries" in status["problem"]
    with pytest.raises(WorkerError, match="no worker could be started") as refused:
        model.translate(NUMBERS, beam_size=1)
    assert 0 < refused.value.retry_after <= ct2_worker.COOLDOWN_S and len(starts) == ct2_worker.START_TRIES
    model.ct2.kwargs["model_path"] = good
    model.ct2.failed_until = time.monotonic()  # the cool-down has passed
    assert model.translate(["seven"], beam_size=1) == ["sieben"]
    assert model.ct2.status()["state"] == "ready" and model.ct2.restarts == 1


def test_errors_of_ctranslate2_come_back_as_their_type(ckpt):
    worker = TranslatorProcess("model", model_path=str(cache.converted(ckpt)), intra_threads=1)
    with pytest.raises(TypeError):
        worker.translate_batch([["seven"]], beam_size="four")
    assert worker.translate_batch([["▁seven"]], beam_size=1)  # the worker goes on after an error
    with pytest.raises(RuntimeError, match="failed to load|Unable to open|No such file|model"):
        TranslatorProcess("nowhere", model_path="/nonexistent/model")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_workers_end_with_the_program_that_started_them(ckpt, how):
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # a terminal's program gets ^C
            f"import qkv, sys\nm = qkv.load({str(ckpt)!r}, engine='ctranslate2', threads=1)\n"
            "m.translate(['seven'], beam_size=1)\nprint(m.ct2.pid, flush=True)\nimport time; time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC}, start_new_session=True)
    try:
        worker = int(proc.stdout.readline())
        assert alive(worker)
        os.killpg(proc.pid, how) if how == signal.SIGINT else os.kill(proc.pid, how)  # ^C reaches the group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_calls_take_as_many_cores_as_their_translator_has_threads_and_wait_while_they_are_taken():
    """Two 2-thread translators decoding at once on 2 cores answered a tenth of one alone
    (benchmarks/serve_models.py): the program's workers take turns on the cores instead."""
    import threading

    from qkv.engines.worker import Cores

    cores = Cores(2)
    assert cores.take(2) == 2 and cores.free == 0
    started, done = threading.Event(), threading.Event()

    def second():
        started.set()
        cores.take(1)
        done.set()
    threading.Thread(target=second, daemon=True).start()
    started.wait(5)
    assert not done.wait(0.3)  # waits while the cores are taken
    cores.give(2)
    assert done.wait(5) and cores.free == 1
    assert cores.take(1) == 1 and cores.free == 0  # two 1-thread calls run side by side
    cores.give(1), cores.give(1)
    assert cores.take(8) == 2  # more threads than cores: the whole machine, not a wait forever
    cores.give(2)


def test_a_translator_with_the_default_threads_takes_every_core(ckpt):
    from qkv.engines.worker import CORES

    assert qkv.load(ckpt, engine="ctranslate2", threads=0).ct2.threads == CORES.total
    assert qkv.load(ckpt, engine="ctranslate2", threads=1).ct2.threads == 1

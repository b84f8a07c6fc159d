"""qkv lab's bounds on the requests that look inside a run, and how a run's end is told: token limits
checked before any model runs, one bounded queue per run (429 beyond it), a checkpoint replaced on disk
served fresh, and the status of a run that was solved, hit its time limit, was stopped or was killed
by a signal, kept across restarts of the lab and written as train.log's last line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='qkv lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import qkv.viz  # noqa: E402
from qkv.lab import lecture  # noqa: E402
from qkv.lab import runs as lab_runs  # noqa: E402
from qkv.lab.app import create_app  # noqa: E402
from qkv.lab.inside import Busy, Checkpoints  # noqa: E402
from qkv.lab.runs import ENDED, Lab, LabLimits  # noqa: E402
from qkv.serve import BackgroundServer  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
LOCAL = "http://127.0.0.1"
LONG = ("ab " * 700)[:2000]  # 2,000 characters: within the lab's character bound, far past 64 tokens
SHORT = "red cat"


def fixture_run(root: Path, name: str, checkpoint: str) -> Path:
    run = root / name
    run.mkdir(parents=True)
    shutil.copytree(FIXTURES / checkpoint, run / "last")
    (run / "lab.json").write_text(json.dumps({"name": name, "task": "copy", "preset": "x"}))
    return run


@pytest.fixture
def decodes(monkeypatch):
    """Every greedy decode the lab's views start (``qkv.viz.attention_data``, a frontend's translate), by
    input length; decoding a long input takes ``slow`` seconds (as a real one of 2,000 characters does)."""
    seen: list[int] = []
    slow = {"s": 0.0}
    real = qkv.viz.attention_data

    def spy(frontend, text, *a, **k):
        seen.append(len(text))
        if len(text) > 100:
            time.sleep(slow["s"])
        return real(frontend, text, *a, **k)

    monkeypatch.setattr(qkv.viz, "attention_data", spy)
    return type("Decodes", (), {"seen": seen, "slow": slow})


@pytest.mark.parametrize("path", ["steps", "gradients", "inside"])
def test_a_long_input_is_refused_before_any_decoding(tmp_path, decodes, path):
    fixture_run(tmp_path / "runs", "tr", "translate-transformer")
    lab = Lab(tmp_path / "runs", LabLimits())  # max_chars 2,000: the text passes the character bound
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        r = c.post(f"/api/runs/tr/{path}", json={"text": LONG})
        assert r.status_code == 422 and f"at most {lecture.MAX_TOKENS}" in r.json()["error"], r.json()
        assert decodes.seen == []  # refused from the tokens alone
        if path == "steps":  # a target given by hand is counted before anything runs too
            r = c.post("/api/runs/tr/steps", json={"text": SHORT, "target": LONG})
            assert r.status_code == 422 and "target" in r.json()["error"] and decodes.seen == []
        r = c.post(f"/api/runs/tr/{path}", json={"text": SHORT})
        assert r.status_code == 200, r.json()
        assert decodes.seen == [len(SHORT)]


def test_a_normal_request_is_answered_while_long_ones_are_in_flight(tmp_path, decodes):
    """Three long inputs and one normal one on the same run at once: the normal one does not wait for
    the long ones (which, decoded in full, would hold the run for 3 x 20 s here)."""
    fixture_run(tmp_path / "runs", "tr", "translate-transformer")
    decodes.slow["s"] = 20.0
    lab = Lab(tmp_path / "runs", LabLimits())
    with BackgroundServer(create_app(lab, panels=None)) as server, httpx.Client(base_url=server.url,
                                                                                  timeout=120) as client:
        assert client.post("/api/runs/tr/steps", json={"text": SHORT}).status_code == 200  # loaded once
        answers: dict = {}

        def ask(key, text):
            t0 = time.monotonic()
            r = client.post("/api/runs/tr/steps", json={"text": text})
            answers[key] = (r.status_code, time.monotonic() - t0)

        threads = [threading.Thread(target=ask, args=(f"long{i}", LONG)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        ask("normal", SHORT)
        for t in threads:
            t.join(120)
    assert answers["normal"][0] == 200 and answers["normal"][1] < 15, answers
    assert all(answers[f"long{i}"][0] == 422 for i in range(3)), answers


def test_each_run_has_a_bounded_queue():
    gate = threading.Event()
    checkpoints = Checkpoints(load=lambda path, device: "model", queue=2)
    a, b = Path("/nowhere/a"), Path("/nowhere/b")
    checkpoints.get = lambda run_dir: "model"  # no files: the queue alone
    done = []
    workers = [threading.Thread(target=lambda: done.append(checkpoints.apply(a, lambda m, x: gate.wait(30) and x, 1)))
               for _ in range(2)]
    for w in workers:
        w.start()
    end = time.monotonic() + 10
    while checkpoints.waiting.get(a, 0) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    with pytest.raises(Busy, match="2 requests in progress"):
        checkpoints.apply(a, lambda m: 0)
    assert checkpoints.apply(b, lambda m: "other run") == "other run"  # another run's requests are not held
    gate.set()
    for w in workers:
        w.join(30)
    assert done == [1, 1] and checkpoints.apply(a, lambda m: "room again") == "room again"


def test_past_the_queue_bound_the_answer_is_429_with_retry_after(tmp_path, monkeypatch):
    fixture_run(tmp_path / "runs", "tr", "translate-transformer")
    gate = threading.Event()
    real = lecture.attention_steps

    def held(frontend, text, **kwargs):
        gate.wait(60)
        return real(frontend, text, **kwargs)

    monkeypatch.setattr(lecture, "attention_steps", held)
    lab = Lab(tmp_path / "runs", LabLimits(run_queue=2))
    with BackgroundServer(create_app(lab, panels=None)) as server, httpx.Client(base_url=server.url,
                                                                                  timeout=120) as client:
        codes = []
        threads = [threading.Thread(target=lambda: codes.append(
            client.post("/api/runs/tr/steps", json={"text": SHORT}).status_code)) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # both taken in: one computing, one waiting
        r = client.post("/api/runs/tr/steps", json={"text": SHORT})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert "2 requests in progress" in r.json()["error"]
        gate.set()
        for t in threads:
            t.join(60)
        assert codes == [200, 200]
        assert client.post("/api/runs/tr/steps", json={"text": SHORT}).status_code == 200


def test_a_checkpoint_replaced_on_disk_is_served_fresh(tmp_path):
    run = fixture_run(tmp_path / "runs", "tr", "translate-transformer")
    lab = Lab(tmp_path / "runs", LabLimits())
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        assert c.post("/api/runs/tr/inside", json={"text": SHORT}).json()["arch"] == "transformer"
        # another checkpoint copied over it, its manifest with the old one's time (a copy that keeps times)
        stat = (run / "last" / "manifest.json").stat()
        shutil.rmtree(run / "last")
        shutil.copytree(FIXTURES / "translate-lstm-general", run / "last")
        os.utime(run / "last" / "manifest.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
        d = c.post("/api/runs/tr/inside", json={"text": SHORT}).json()
        assert d["arch"] == "lstm" and "hidden" in d
        # its weights edited in place, the manifest untouched: checked again, never the old model
        weights = run / "last" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        os.utime(run / "last" / "manifest.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
        r = c.post("/api/runs/tr/inside", json={"text": SHORT})
        assert r.status_code == 422 and "cannot be read" in r.json()["error"], r.json()


# --- how a run ended ----------------------------------------------------------------------------------

class Fake(subprocess.Popen):
    """A stand-in for ``qkv train`` that runs ``SCRIPT`` with the run's directory as its argument."""

    SCRIPT = "import time; time.sleep(120)"

    def __init__(self, argv, **kwargs):
        out = argv[argv.index("--out") + 1]
        super().__init__([sys.executable, "-c", self.SCRIPT, out], **kwargs)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(lab_runs.subprocess, "Popen", Fake)
    return Fake


def wait_ended(lab: Lab, name: str, timeout: float = 30) -> None:
    lab.procs[name].wait(timeout)
    end = time.monotonic() + timeout
    while not (lab.root / name / ENDED).is_file() and time.monotonic() < end:
        time.sleep(0.05)


def last_line(root: Path, name: str) -> str:
    return (root / name / "train.log").read_text().strip().splitlines()[-1]


def test_a_run_killed_by_a_signal_says_so_and_keeps_saying_it(tmp_path, fake):
    root = tmp_path / "runs"
    lab = Lab(root)
    lab.start("k", "copy", "transformer")
    os.kill(lab.procs["k"].pid, signal.SIGKILL)
    wait_ended(lab, "k")
    d = lab.describe("k")
    assert d["status"] == "failed" and d["reason"] == "killed by SIGKILL (signal 9)"
    assert last_line(root, "k") == "qkv lab: failed: killed by SIGKILL (signal 9)"
    again = Lab(root).describe("k")  # a restarted lab
    assert again["status"] == "failed" and again["reason"] == "killed by SIGKILL (signal 9)"
    lab.stop_all()


def test_a_time_limited_run_says_time_limit(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(Fake, "SCRIPT", "import json, sys, pathlib\n"
                        "pathlib.Path(sys.argv[1], 'metrics.jsonl').write_text(json.dumps({'step': 300}) + '\\n')\n"
                        "print('stopped: reached max_time=5s; checkpoints in x/last and x/best')")
    root = tmp_path / "runs"
    lab = Lab(root)
    lab.start("t", "copy", "transformer", train={"max_time": 5})
    wait_ended(lab, "t")
    assert lab.status("t") == "time limit"
    assert lab.describe("t")["reason"] == "reached its time limit (5s) at update 300"
    assert last_line(root, "t") == "qkv lab: time limit: reached its time limit (5s) at update 300"
    assert Lab(root).status("t") == "time limit"


def test_solved_and_stopped_are_kept_across_restarts(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(Fake, "SCRIPT", "import json, sys, pathlib, time\n"
                        "pathlib.Path(sys.argv[1], 'metrics.jsonl').write_text(json.dumps("
                        "{'step': 400, 'valid_exact': 0.995}) + '\\n')\n"
                        "time.sleep(120)")
    root = tmp_path / "runs"
    lab = Lab(root)
    lab.start("s", "copy", "transformer")  # stopped by the lab once solved
    wait_ended(lab, "s")
    monkeypatch.setattr(Fake, "SCRIPT", "import time; time.sleep(120)")
    lab.start("p", "copy", "transformer")
    lab.stop("p")
    wait_ended(lab, "p")
    assert lab.status("s") == "solved" and "exact 99.5% at update 400" in lab.describe("s")["reason"]
    assert lab.status("p") == "stopped"
    assert last_line(root, "s").startswith("qkv lab: solved: exact 99.5% at update 400")
    assert last_line(root, "p").startswith("qkv lab: stopped")
    later = Lab(root)
    assert later.status("s") == "solved" and later.status("p") == "stopped"
    lab.stop_all()


# --- a run's identity -----------------------------------------------------------------------------------

def test_hues_are_chosen_apart_recorded_and_kept(tmp_path, fake, monkeypatch):
    from qkv.lab.runs import name_hue, pick_hue

    assert pick_hue("x", []) == name_hue("x") and 0 <= name_hue("anything") < 360
    root = tmp_path / "runs"
    lab = Lab(root, LabLimits(max_runs=12))
    hues = {}
    for k in range(12):
        lab.start(f"r{k}", "copy", "transformer")
        hues[f"r{k}"] = json.loads((root / f"r{k}" / "lab.json").read_text())["hue"]
    values = list(hues.values())
    for i in range(12):
        for j in range(i):
            d = abs(values[i] - values[j]) % 360
            assert min(d, 360 - d) >= 22, values  # 12 hues, each farthest from those before it
    lab.stop_all()
    with TestClient(create_app(Lab(root), panels=None), base_url=LOCAL) as c:
        assert c.delete("/api/runs/r3").json() == {"deleted": "r3"} and not (root / "r3").exists()
        assert c.delete("/api/runs/r3").status_code == 404
        listed = {r["name"]: r["hue"] for r in c.get("/api/runs").json()["runs"]}
        assert listed == {n: h for n, h in hues.items() if n != "r3"}  # the others keep theirs


def test_a_training_run_is_not_deleted(tmp_path, fake):
    root = tmp_path / "runs"
    lab = Lab(root)
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        assert c.post("/api/runs", json={"name": "busy", "task": "copy"}).status_code == 201
        r = c.delete("/api/runs/busy")
        assert r.status_code == 409 and "stop it first" in r.json()["error"] and (root / "busy").is_dir()
        c.post("/api/runs/busy/stop")
        lab.procs["busy"].wait(30)
        assert c.delete("/api/runs/busy").status_code == 200 and not (root / "busy").exists()
        assert c.get("/api/runs").json()["runs"] == []


def test_the_parameter_count_is_the_models_own_once_it_has_a_checkpoint(tmp_path):
    from qkv.frontends import load

    root = tmp_path / "runs"
    fixture_run(root, "tr", "translate-transformer")
    (root / "new").mkdir()
    (root / "new" / "lab.json").write_text(json.dumps({"name": "new", "task": "copy", "preset": "x",
                                                        "parameters": 123}))
    lab = Lab(root)
    model = load(FIXTURES / "translate-transformer").model
    # the model's own parameters, each counted once (shared embeddings too)
    real = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    d = lab.describe("tr")
    assert d["parameters"] == real and d["parameters_counted"] is True
    assert lab.describe("new")["parameters"] == 123 and "parameters_counted" not in lab.describe("new")

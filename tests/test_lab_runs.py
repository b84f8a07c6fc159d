"""qkv lab: how its runs live and die. A run lives until it ends or is stopped, whatever thread started
it and whatever requests come meanwhile; it dies with the lab's process however that ends (SIGINT,
SIGTERM, kill -9). The bound on runs holds under concurrent starts, which never share a file, and
every refusal is JSON.

Real ``qkv train`` processes where the lifeline is tested (a tiny model, stopped within seconds);
elsewhere a stand-in process that only waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qkv.data import synthetic
from qkv.lab import runs as lab_runs
from qkv.lab.runs import TASKS, Lab, LabLimits

fastapi = pytest.importorskip("fastapi", reason='qkv lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
from fastapi.testclient import TestClient  # noqa: E402

from qkv.lab.app import create_app  # noqa: E402

LOCAL = "http://127.0.0.1"
SRC = str(Path(__file__).parents[1] / "src")
# a Transformer small enough to start in seconds, with nothing that ends it soon
TINY = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_encoder_layers": 1, "n_decoder_layers": 1}
LONG = {"eval_every": 100_000, "max_steps": 1_000_000}
linux = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


class Waiter(subprocess.Popen):
    """A stand-in for ``qkv train``: a process that waits until it is signalled, writing nothing."""

    def __init__(self, argv, **kwargs):
        super().__init__([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)
        self.lab_argv = argv  # what the lab would have run


@pytest.fixture
def waiting(monkeypatch):
    monkeypatch.setattr(lab_runs.subprocess, "Popen", Waiter)


def wait_training(lab: Lab, name: str, timeout: float = 180) -> None:
    """Until the run has logged its first update (its trainer is running, signal handlers in place)."""
    deadline = time.monotonic() + timeout
    while not lab.metrics(name)["records"]:
        assert lab.procs[name].poll() is None, lab.log_tail(name, 20)
        assert time.monotonic() < deadline, lab.log_tail(name, 20)
        time.sleep(0.2)


def assert_lives(lab: Lab, name: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert lab.procs[name].poll() is None, f"the run ended: {lab.log_tail(name, 20)}"
        time.sleep(0.2)
    assert "interrupted" not in lab.log_tail(name, 50)


# --- a run outlives whatever started it ----------------------------------------------------------

def test_a_run_outlives_the_thread_that_started_it(tmp_path):
    """The thread that spawned a run ends (as a thread pool's idle worker does): the run goes on."""
    lab = Lab(tmp_path / "runs")

    def starter():
        lab.start("t", "copy", "transformer", TINY, LONG)
        wait_training(lab, "t")  # the run is past its start-up before its spawning thread ends

    thread = threading.Thread(target=starter)
    thread.start()
    thread.join()
    try:
        assert_lives(lab, "t", 6)
    finally:
        lab.stop_all()
    assert lab.status("t") == "stopped"


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=120) as r:
        return r.status


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_panel_requests_and_a_pause_do_not_end_a_run(tmp_path):
    """The reproduction, over HTTP: start a run, panel requests at once, 12 s of quiet, one more request:
    the run still trains. The server's thread pool serves the start and the panels; after 10 s idle, the
    next request takes the worker that finished last and retires the others: the one that spawned the
    run among them unless it happened to finish last (with PR_SET_PDEATHSIG that ended the run: with
    eight requests at once, 7 times in 8 or more)."""
    from qkv.serve import BackgroundServer

    lab = Lab(tmp_path / "runs")
    with BackgroundServer(create_app(lab, panels=None)) as server:
        status, answer = post(server.url + "/api/runs", {"name": "t", "task": "copy", "model": TINY, "train": LONG})
        assert status == 201, answer
        answers = []
        barrier = threading.Barrier(8)

        def panel(d_k):
            barrier.wait()
            answers.append(get(f"{server.url}/api/panels/attention?d_k={d_k}"))

        threads = [threading.Thread(target=panel, args=(d_k,)) for d_k in (4, 8, 16, 32, 64, 128, 256, 512)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [200] * 8
        time.sleep(12)
        assert get(server.url + "/api/panels/attention?d_k=24") == 200
        assert_lives(lab, "t", 6)
        assert lab.status("t") == "training"
    assert lab.status("t") == "stopped"  # the lab's end stopped it


# --- ... and dies with the lab ------------------------------------------------------------------------

def test_a_run_ends_when_its_lifeline_closes():
    """The child's watcher: the lifeline's write end closed (the lab's process gone, by SIGKILL here)
    -> SIGTERM to the run."""
    child = ("import sys, time; from qkv.lab.child import die_with_lab; "
             "die_with_lab(int(sys.argv[1])); print('ready', flush=True); time.sleep(60)")
    parent = ("import os, subprocess, sys, time; r, w = os.pipe(); "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}, str(r)], pass_fds=(r,), stdout=sys.stdout); "
              "print(p.pid, flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": SRC}
    lab_process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env)
    run = int(lab_process.stdout.readline())
    assert lab_process.stdout.readline().strip() == "ready"
    os.kill(run, 0)  # alive while the lab is
    time.sleep(1)
    os.kill(run, 0)
    lab_process.kill()
    lab_process.wait()
    assert ended(run, 20), "the run outlived the lab's process"


def ended(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reaped by init once it ends; a zombie counts as ended
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


@linux
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_no_run_outlives_the_lab(tmp_path, sig):
    """``qkv lab`` as a process, one real run: however the lab ends, the run ends too."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    lab = subprocess.Popen([sys.executable, "-m", "qkv", "lab", "--port", "0", "--root", str(tmp_path / "runs")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = lab.stdout.readline()
        assert "qkv lab on http://127.0.0.1:" in line, line
        url = line.split(" on ")[1].split()[0].rstrip("/")
        status, answer = post(url + "/api/runs", {"name": "t", "task": "copy", "model": TINY, "train": LONG})
        assert status == 201, answer
        deadline = time.monotonic() + 60
        while len(descendants(lab.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        zygote = children_of(lab.pid)
        assert len(zygote) == 1, zygote  # the zygote (qkv.lab.zygote), which forked the run
        runs = children_of(zygote[0])
        assert len(runs) == 1, runs
        time.sleep(2)
        os.kill(runs[0], 0)  # training
        lab.send_signal(sig)
        lab.wait(90)
        assert ended(runs[0], 90), f"the run outlived the lab ({sig.name})"
        assert ended(zygote[0], 30), f"the zygote outlived the lab ({sig.name})"
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()


# --- warm starts: runs forked from the zygote, which has imported torch and the trainer -------------------

def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


def first_record(lab: Lab, name: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not lab.metrics(name)["records"]:
        assert lab.status(name) == "training" and time.monotonic() < deadline, lab.log_tail(name, 20)
        time.sleep(0.2)
    return lab.metrics(name)["records"][0]


@linux
def test_a_warm_run_is_forked_from_the_zygote_and_ends_as_a_cold_one_does(tmp_path):
    """With warm(), a run is a fork of the zygote (not a fresh interpreter: its command line is the
    zygote's, its parent the zygote), trains, stops on request with last/ committed and its reason
    recorded; one killed outright says so; the zygote's end (kill -9) leaves its running run to end as
    asked, sends the next run cold, and a new zygote takes the one after."""
    from qkv.lab.zygote import WarmRun

    lab = Lab(tmp_path / "runs", LabLimits(max_runs=2))
    lab.warm()
    try:
        assert lab.zygote.ready.wait(180), "the zygote did not finish its imports"
        zygote = lab.zygote.proc.pid
        lab.start("w", "copy", "transformer", model=TINY, train=LONG)
        run = lab.procs["w"]
        assert isinstance(run, WarmRun) and parent_of(run.pid) == zygote
        assert cmdline(run.pid)[1:3] == ["-m", "qkv.lab.zygote"]  # a fork: no interpreter of its own
        assert first_record(lab, "w")["step"] == 1
        assert os.getsid(run.pid) == run.pid  # a session of its own, as a cold run's start_new_session
        assert lab.stop("w")["status"] in ("stopping", "stopped")
        assert run.wait(120) == 130  # qkv's status for an interrupted command, as a cold run ends
        info = lab.describe("w")
        assert info["status"] == "stopped" and info["checkpoint"], lab.log_tail("w", 20)
        assert "interrupted at step" in lab.log_tail("w", 20)

        lab.start("k", "copy", "transformer", model=TINY, train=LONG)
        first_record(lab, "k")
        os.kill(lab.procs["k"].pid, signal.SIGKILL)
        assert lab.procs["k"].wait(30) == -signal.SIGKILL
        time.sleep(1)  # the watcher records how it ended
        d = lab.describe("k")
        assert d["status"] == "failed" and d["reason"] == "killed by SIGKILL (signal 9)", d

        lab.start("o", "copy", "transformer", model=TINY, train=LONG)  # a run the zygote will not see end
        first_record(lab, "o")
        os.kill(zygote, signal.SIGKILL)
        lab.zygote.proc.wait(10)
        assert lab.procs["o"].poll() is None  # a run outlives the zygote that forked it
        lab.stop("o")
        assert lab.procs["o"].wait(120) is not None  # its end seen without the zygote
        assert lab.describe("o")["status"] == "stopped"
        lab.start("c", "copy", "transformer", model=TINY, train=LONG)
        assert isinstance(lab.procs["c"], subprocess.Popen)  # cold: nothing to fork from
        assert lab.zygote.alive() and lab.zygote.proc.pid != zygote  # and the next run gets a new zygote
        assert first_record(lab, "c")["step"] == 1
    finally:
        lab.stop_all(60)
    assert not lab.running()


@linux
def test_warm_runs_end_with_the_lab_and_so_does_the_zygote(tmp_path):
    """The lifeline holds for forked runs: the lab's end (its write end closed) stops the run and ends
    the zygote."""
    lab = Lab(tmp_path / "runs")
    lab.warm()
    assert lab.zygote.ready.wait(180)
    zygote = lab.zygote.proc
    lab.start("w", "copy", "transformer", model=TINY, train=LONG)
    first_record(lab, "w")
    pid = lab.procs["w"].pid
    lab.zygote = None  # as if the lab's process were gone: only the lifeline tells them
    lab.close()
    assert ended(pid, 90), "the forked run outlived the lab's lifeline"
    assert zygote.wait(30) is not None


# --- the bound holds under concurrent starts; no start shares a file ------------------------------------

def test_six_starts_at_once_against_max_runs_2(tmp_path, waiting):
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=2))
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        replies = [None] * 6
        barrier = threading.Barrier(6)

        def post(i):
            barrier.wait()
            replies[i] = c.post("/api/runs", json={"name": f"r{i}", "task": "copy"})

        threads = [threading.Thread(target=post, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bodies = [r.json() for r in replies]  # every answer is JSON
        codes = sorted(r.status_code for r in replies)
        assert codes == [201, 201, 429, 429, 429, 429], bodies
        assert len(lab.running()) == 2
        for r in replies:
            if r.status_code == 429:
                assert "2 runs are training already" in r.json()["error"]
    for name, (src, tgt) in {"train": ("src.train", "tgt.train"), "valid": ("src.valid", "tgt.valid")}.items():
        pairs = synthetic.splits("copy")[name]
        data = tmp_path / "runs" / ".data" / "copy"
        assert (data / src).read_text().splitlines() == [s for s, _ in pairs]
        assert (data / tgt).read_text().splitlines() == [t for _, t in pairs]
    assert not list((tmp_path / "runs" / ".data" / "copy").glob("*.tmp"))


def test_labs_sharing_a_root_write_the_data_once_each_whole(tmp_path):
    """Two labs on one root (or two starts) write the same task's files at once: each through a temporary
    file of its own, so every writer succeeds and every file is whole."""
    labs = [Lab(tmp_path / "runs") for _ in range(6)]
    errors = []
    barrier = threading.Barrier(6)

    def write(lab):
        barrier.wait()
        try:
            lab.data(TASKS["reverse"])
        except Exception as e:  # noqa: BLE001 - what the test reports
            errors.append(repr(e))

    threads = [threading.Thread(target=write, args=(lab,)) for lab in labs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pairs = synthetic.splits("reverse")["valid"]
    assert (tmp_path / "runs" / ".data" / "reverse" / "tgt.valid").read_text().splitlines() == [t for _, t in pairs]


def test_fields_are_checked_before_the_room(tmp_path, waiting):
    """A full lab still names what is wrong with a request: 422 before 429."""
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=1))
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        assert c.post("/api/runs", json={"name": "one", "task": "copy"}).status_code == 201
        r = c.post("/api/runs", json={"name": "two", "task": "copy", "model": {"d_model": -4}})
        assert r.status_code == 422 and "d_model" in r.json()["error"]
        r = c.post("/api/runs", json={"name": "two", "task": "rot13"})
        assert r.status_code == 422 and "rot13" in r.json()["error"]
        r = c.post("/api/runs", json={"name": "two", "task": "copy"})
        assert r.status_code == 429


def test_a_fault_of_the_lab_is_json(tmp_path, monkeypatch):
    """Where the lab itself fails (here: the data folder cannot be written), the answer is still JSON."""
    lab = Lab(tmp_path / "runs")

    def broken(task):
        raise PermissionError(13, "Permission denied", str(tmp_path / "runs" / ".data"))

    monkeypatch.setattr(lab, "data", broken)
    with TestClient(create_app(lab, panels=None), base_url=LOCAL, raise_server_exceptions=False) as c:
        r = c.post("/api/runs", json={"name": "x", "task": "copy"})
    assert r.status_code == 500 and "PermissionError" in r.json()["error"]


# --- the form: lists of legal values, numbers that parse and fit -------------------------------------------

def test_choices_are_qkvs_own_lists(tmp_path):
    from qkv import config

    lab = Lab(tmp_path / "runs")
    about = TestClient(create_app(lab, panels=None), base_url=LOCAL).get("/api/lab").json()
    assert about["choices"]["arch"] == list(config.ARCHS)
    assert about["choices"]["attention"] == list(config.ATTENTION_SCORES)
    assert set(about["choices"]["attention"]) >= {"dot", "scaled_dot", "general", "additive", "cosine", "location"}
    assert about["choices"]["positional"] == list(config.POSITIONALS) and "none" in config.POSITIONALS
    assert about["choices"]["schedule"] == list(config.SCHEDULES)
    assert about["choices"]["norm_first"] == [False, True]
    assert about["bounds"]["d_model"] == {"low": 2, "high": 1024, "text": "2 to 1024"}
    assert about["max_parameters"] == lab_runs.MAX_PARAMETERS
    for preset in about["presets"].values():  # every value a preset sets is one of the choices
        for field, value in {**preset["model"], **preset["train"]}.items():
            if field in about["choices"]:
                assert value in about["choices"][field], (field, value)
    copy = next(t for t in about["tasks"] if t["name"] == "copy")
    assert copy["metrics"] == ["valid_exact"]  # no BLEU where outputs are one word


@pytest.mark.parametrize("model,train,message", [
    ({"d_model": "abc"}, {}, "'d_model' must be of type int, got 'abc'"),
    ({"d_model": ""}, {}, "'d_model' must be of type int, got ''"),
    ({"d_model": None}, {}, "'d_model' must be of type int, got None"),
    ({"d_model": 64.5}, {}, "'d_model' must be of type int"),
    ({"d_model": 1e9}, {}, "model.d_model: this lab takes 2 to 1024 (so that a run fits this machine), got 1,000,000,000"),
    ({"n_encoder_layers": 100}, {}, "model.n_encoder_layers: this lab takes 1 to 8"),
    ({"d_model": 1024, "d_ff": 4096, "n_heads": 16, "n_encoder_layers": 8, "n_decoder_layers": 8}, {},
     "parameters; this lab trains at most 20,000,000"),
    ({"positional": "alibi"}, {}, "positional"),
    ({"attention": "dotty"}, {}, "did you mean 'dot'"),
    ({}, {"lr": "fast"}, "'lr' must be of type float"),
    ({}, {"schedule": "cosine"}, "schedule"),
])
def test_numbers_and_choices_refused_by_name(tmp_path, waiting, model, train, message):
    lab = Lab(tmp_path / "runs")
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        r = c.post("/api/runs", json={"name": "x", "task": "copy", "model": model, "train": train})
        assert r.status_code == 422 and message in r.json()["error"], r.json()
        assert not lab.procs


def test_noam_pre_norm_no_positions_start(tmp_path, waiting):
    """The noam schedule needs no field the form lacks (the preset's lr gives way); pre-norm and no
    positions reach the run's flags."""
    lab = Lab(tmp_path / "runs")
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        r = c.post("/api/runs", json={"name": "x", "task": "reverse", "model": {"positional": "none", "norm_first": True},
                                      "train": {"schedule": "noam", "lr_scale": 2}})
        assert r.status_code == 201, r.json()
        info = r.json()
        assert info["train"]["schedule"] == "noam" and info["train"]["lr"] == 0 and info["train"]["lr_scale"] == 2.0
        assert info["model"]["positional"] == "none" and info["model"]["norm_first"] is True
        assert info["parameters"] == lab_runs.parameters(info["model"], 64)
        argv = lab.procs["x"].lab_argv
        assert "--norm-first" in argv and argv[argv.index("--positional") + 1] == "none"
        r = c.post("/api/runs", json={"name": "y", "task": "copy", "train": {"schedule": "noam", "lr": 0.01}})
        assert r.status_code == 422 and "noam schedule sets its own rate" in r.json()["error"]


def test_parameter_count_against_the_formula():
    """The count the bound uses equals the Transformer's by hand: shared embedding V·d, per encoder layer
    4(d² + d) + 2·d·d_ff + d_ff + d + 2·2d (two LayerNorms), per decoder layer one attention and norm more."""
    d, f, v = 16, 32, 64
    attn, ffn, norm = 4 * (d * d + d), 2 * d * f + f + d, 2 * d
    expected = v * d + 2 * (attn + ffn + 2 * norm) + 2 * (2 * attn + ffn + 3 * norm)
    model = {"arch": "transformer", "d_model": d, "n_heads": 2, "d_ff": f, "n_encoder_layers": 2, "n_decoder_layers": 2}
    assert lab_runs.parameters(model, v) == expected


def test_without_positions_a_transformer_cannot_tell_an_input_from_its_reversal():
    """Self-attention without positions is permutation-equivariant, so the encoder's memory for "abcd" is that
    of "dcba" permuted and cross-attention, a weighted sum over the memory, gives the decoder the same
    inputs for both: equal output distributions, so at most one of the two reversals is right. With
    sinusoidal positions the two differ."""
    import torch

    from qkv.config import ModelConfig
    from qkv.models import build_model

    src = torch.tensor([[7, 8, 9, 10, 3]])  # "abcd" </s>
    rev = torch.tensor([[10, 9, 8, 7, 3]])  # "dcba" </s>
    tgt_in = torch.tensor([[2, 11, 12]])  # <s> and two target tokens
    logits = {}
    for positional in ("none", "sinusoidal"):
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                          attention_dropout=0.0, positional=positional, src_vocab_size=20, tgt_vocab_size=20)
        model = build_model(cfg).eval()
        with torch.no_grad():
            logits[positional] = (model(src, tgt_in), model(rev, tgt_in))
    a, b = logits["none"]
    assert torch.allclose(a, b, atol=1e-5)
    a, b = logits["sinusoidal"]
    assert (a - b).abs().max() > 1e-3


def test_a_run_stops_itself_once_solved(tmp_path, waiting):
    """At its first validation exact match >= 99%, a run that asked for it is stopped (status solved); a run
    that did not ask goes on."""
    lab = Lab(tmp_path / "runs")
    lab.start("a", "copy", "transformer")
    lab.start("b", "copy", "transformer", stop_when_solved=False)
    for name in ("a", "b"):
        (tmp_path / "runs" / name / "metrics.jsonl").write_text(
            '{"step": 100, "valid_exact": 0.5}\n{"step": 200, "valid_exact": 0.995}\n')
    deadline = time.monotonic() + 30
    while lab.status("a") != "solved":
        assert time.monotonic() < deadline, lab.status("a")
        time.sleep(0.2)
    assert lab.status("b") == "training"
    assert lab.describe("a")["stop_when_solved"] is True and lab.describe("b")["stop_when_solved"] is False
    lab.stop_all()


def test_inside_names_the_checkpoints_own_step(tmp_path):
    """The page says the update of the checkpoint it looked at: 1318 for a stop at update 1318, not the
    last validation's 1300 (read from the checkpoint's trainer state)."""
    import shutil

    import torch

    run = tmp_path / "runs" / "tr"
    run.mkdir(parents=True)
    shutil.copytree(Path(__file__).parent / "fixtures" / "checkpoints" / "translate-transformer", run / "last")
    (run / "lab.json").write_text(json.dumps({"name": "tr", "task": "copy", "preset": "transformer"}))
    (run / "metrics.jsonl").write_text('{"step": 1300, "valid_loss": 0.1}\n')
    torch.save({"step": 1318, "epoch": 3}, run / "last" / "trainer_state.pt")
    lab = Lab(tmp_path / "runs")
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        r = c.post("/api/runs/tr/inside", json={"text": "red cat"})
        assert r.status_code == 200 and r.json()["step"] == 1318, r.json()
        (run / "last" / "trainer_state.pt").unlink()
        assert c.post("/api/runs/tr/inside", json={"text": "red cat"}).json()["step"] is None


# --- encoder-only and decoder-only runs ----------------------------------------------------------------

def test_one_sided_tasks_data_and_settings(tmp_path):
    """The classifier's data is JSONL text and label, by the long-range rule; the language models' data
    are a string and its reversal; the model's task follows the lab's task."""
    lab = Lab(tmp_path / "runs")
    flags_ = lab.data(TASKS["long_range_label"])
    assert flags_[0] == "--train" and flags_[2] == "--valid"
    for line in Path(flags_[1]).read_text().splitlines()[:50]:
        row = json.loads(line)
        assert row["label"] == row["text"][len(row["text"]) - 1 - 16]
    for line in Path(lab.data(TASKS["mirror_lm"])[3]).read_text().splitlines():
        s, t = line.split(" ")
        assert t == s[::-1]
    assert lab_runs.settings("transformer", kind="lm")[0]["task"] == "lm"
    assert lab_runs.settings("gru", kind="classify")[0]["pooling"] == "mean"
    assert "task" not in lab_runs.settings("transformer")[0]


def test_encoder_only_and_decoder_only_runs_train(tmp_path):
    """A classifier, a masked LM (encoder-only) and a language model (decoder-only) train in the lab,
    each logging its own validation score; a recurrent masked LM is refused by name."""
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=3))
    short = {"max_steps": 20, "eval_every": 10}
    tiny = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_encoder_layers": 1, "n_decoder_layers": 1}
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        r = c.post("/api/runs", json={"name": "bad", "task": "mirror_mlm", "preset": "lstm"})
        assert r.status_code == 422 and "no 'lstm' model for task 'mlm'" in r.json()["error"]
        for name, task in (("cls", "long_range_label"), ("mlm", "mirror_mlm"), ("lm", "mirror_lm")):
            r = c.post("/api/runs", json={"name": name, "task": task, "model": tiny, "train": short})
            assert r.status_code == 201, r.json()
        for name in ("cls", "mlm", "lm"):
            lab.procs[name].wait(240)
        for name, key in (("cls", "valid_accuracy"), ("mlm", "valid_ppl"), ("lm", "valid_ppl")):
            assert lab.status(name) == "finished", lab.log_tail(name, 20)
            records = c.get(f"/api/runs/{name}/metrics").json()["records"]
            assert any(key in r for r in records), records
        about = {t["name"]: t for t in c.get("/api/lab").json()["tasks"]}
        assert about["long_range_label"]["solved_by"] == "valid_accuracy" and about["mirror_lm"]["solved_by"] is None


def test_the_paper_against_llama_style_on_reverse(tmp_path):
    """The llama-style preset (rotary positions, pre-norm RMSNorm, SwiGLU, grouped-query attention, no biases)
    trains from scratch on reverse beside the paper's Transformer: its switches reach the run's flags and its
    checkpoint, and both log validation."""
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=2))
    short = {"max_steps": 20, "eval_every": 10}
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        about = c.get("/api/lab").json()
        assert about["choices"]["norm"] == ["layernorm", "rmsnorm"] and about["choices"]["ffn_gated"] == [False, True]
        for name, preset in (("paper", "transformer"), ("llama", "llama-style")):
            r = c.post("/api/runs", json={"name": name, "task": "reverse", "preset": preset, "train": short})
            assert r.status_code == 201, r.json()
        argv = lab_runs.flags(lab_runs.settings("llama-style", kind="translate")[0])
        assert argv[argv.index("--positional") + 1] == "rotary" and argv[argv.index("--norm") + 1] == "rmsnorm"
        assert "--ffn-gated" in argv and argv[argv.index("--n-kv-heads") + 1] == "2" and "--no-qkv-bias" in argv
        for name in ("paper", "llama"):
            lab.procs[name].wait(240)
            assert lab.status(name) == "finished", lab.log_tail(name, 20)
            records = c.get(f"/api/runs/{name}/metrics").json()["records"]
            assert any("valid_exact" in r for r in records), records
    saved = json.loads((tmp_path / "runs" / "llama" / "last" / "config.json").read_text())["model"]
    assert (saved["positional"], saved["norm"], saved["ffn_gated"], saved["n_kv_heads"]) == ("rotary", "rmsnorm", True, 2)
    assert saved["activation"] == "silu" and saved["norm_first"] is True and saved["qkv_bias"] is False

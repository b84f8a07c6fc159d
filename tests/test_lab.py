"""qkv lab: the generated tasks, the run settings, and the API through FastAPI's test client (runs are
real ``qkv train`` processes where the test needs one, else a stand-in process that only waits)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkv.data import synthetic
from qkv.errors import ConfigError, QkvError
from qkv.lab import runs as lab_runs
from qkv.lab.runs import Lab, LabLimits, flags, settings

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
LOCAL = "http://127.0.0.1"


# --- the generated tasks ----------------------------------------------------------------------------

def test_transforms_by_hand():
    assert synthetic.copy("cab") == "cab"
    assert synthetic.reverse("cab") == "bac"
    assert synthetic.sort("cabca") == "aabcc"


@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
def test_splits_follow_their_rule_and_hold_out_validation(task):
    rule = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s))}[task]
    d = synthetic.splits(task, n_train=300, n_valid=50, min_len=2, max_len=6, symbols=5, seed=3)
    assert len(d["valid"]) == 50 and 0 < len(d["train"]) <= 300
    for s, t in d["train"] + d["valid"]:
        assert t == rule(s) and 2 <= len(s) <= 6 and set(s) <= set("abcde")
    assert not {s for s, _ in d["valid"]} & {s for s, _ in d["train"]}
    assert synthetic.splits(task, n_train=300, n_valid=50, seed=3) == synthetic.splits(task, n_train=300, n_valid=50,
                                                                                         seed=3)


def test_long_range_pairs_answer_the_symbol_distance_before_the_last():
    pairs = synthetic.long_range_pairs(20, distance=7, symbols=6, seed=2)
    for s, t in pairs:
        assert len(s) == synthetic.PREFIX + 1 + 7  # T = PREFIX + 1 + t
        assert t == s[len(s) - 1 - 7]  # position T - t (1-based)


def test_bad_generated_task_settings_are_named():
    with pytest.raises(QkvError, match="unknown generated task 'rot13'"):
        synthetic.splits("rot13")
    with pytest.raises(QkvError, match="symbols must be in"):
        synthetic.splits("copy", symbols=40)


# --- settings -----------------------------------------------------------------------------------------

def test_settings_preset_then_hand():
    m, t = settings("lstm+attention", {"attention": "dot", "d_model": 32}, {"lr": 0.01})
    assert (m["arch"], m["attention"], m["d_model"], t["lr"]) == ("lstm", "dot", 32, 0.01)
    assert t["eval_every"] == lab_runs.TRAIN["eval_every"]


@pytest.mark.parametrize("model,train,message", [
    ({"d_model": 30}, {}, "n_heads"),  # 30 is not divisible by the preset's 4 heads
    ({"max_positions": 9}, {}, "max_positions cannot be set here"),
    ({}, {"lr": -1.0}, "'lr'"),
])
def test_settings_refused_by_name(model, train, message):
    with pytest.raises(ConfigError, match=message):
        settings("transformer", model, train)


def test_flags():
    assert flags({"d_model": 64, "bidirectional": False, "norm_first": True, "lr": 0.002}) == [
        "--d-model", "64", "--no-bidirectional", "--norm-first", "--lr", "0.002"]


# --- the API --------------------------------------------------------------------------------------------

fastapi = pytest.importorskip("fastapi", reason='qkv lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
from fastapi.testclient import TestClient  # noqa: E402

from qkv.lab.app import MARKER, create_app, page_html  # noqa: E402


class Waiter(subprocess.Popen):
    """A stand-in for ``qkv train``: a process that waits until it is signalled, writing nothing."""

    def __init__(self, argv, **kwargs):
        super().__init__([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)


@pytest.fixture
def waiting(monkeypatch):
    monkeypatch.setattr(lab_runs.subprocess, "Popen", Waiter)


@pytest.fixture
def client(tmp_path):
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=2, max_body_bytes=2000, max_chars=50))
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        yield c


def test_about_lists_tasks_and_presets(client):
    about = client.get("/api/lab").json()
    assert [t["name"] for t in about["tasks"]] == ["copy", "reverse", "sort", "long_range", "numbers",
                                                   "long_range_label", "mirror_mlm", "mirror_lm"]
    assert {"transformer", "lstm", "lstm+attention", "gru", "rnn"} <= set(about["presets"])
    assert about["presets"]["transformer"]["model"]["n_heads"] == 4
    assert about["limits"]["max_runs"] == 2


def test_host_header_and_body_bound_of_serve(client):
    r = client.get("/api/lab", headers={"host": "evil.example"})
    assert r.status_code == 400 and "does not answer the host name 'evil.example'" in r.json()["error"]
    assert "allowed-hosts" not in r.json()["error"]  # the lab answers loopback names only: nothing widens it
    r = client.post("/api/runs", content=json.dumps({"name": "x" * 3000, "task": "copy"}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "at most 2,000" in r.json()["error"]


@pytest.mark.parametrize("body,status,message", [
    ({"name": "../up", "task": "copy"}, 422, "not a run name"),
    ({"name": "a", "task": "rot13"}, 422, "unknown 'rot13'"),
    ({"name": "a", "task": "copy", "preset": "lstm", "model": {"d_model": -4}}, 422, "model.d_model: this lab takes 2 to 1024"),
    ({"name": "a", "task": "copy", "threads": 5}, 422, "threads must be in [1, 1]"),
    ({"name": "a", "task": "copy", "colour": "red"}, 422, "colour"),
    ({"name": "a", "task": "copy", "train": {"max_time": 9999}}, 422, "more than this lab allows (--max-time 600)"),
])
def test_start_refused_with_the_reason(client, body, status, message):
    r = client.post("/api/runs", json=body)
    assert r.status_code == status and message in r.json()["error"], r.json()
    assert client.get("/api/runs").json()["runs"] == []


def test_runs_bounded_stopped_and_stopped_with_the_lab(tmp_path, waiting):
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=2))
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        for name in ("one", "two"):
            assert c.post("/api/runs", json={"name": name, "task": "copy"}).status_code == 201
        r = c.post("/api/runs", json={"name": "three", "task": "copy"})
        assert r.status_code == 429 and "2 runs are training" in r.json()["error"]
        assert c.post("/api/runs", json={"name": "one", "task": "reverse"}).status_code == 409
        assert c.post("/api/runs/one/stop").json()["status"] in ("stopping", "stopped")
        lab.procs["one"].wait(10)
        assert c.get("/api/runs/one/metrics").json()["status"] == "stopped"
        assert c.post("/api/runs/one/stop").status_code == 409
        assert c.post("/api/runs", json={"name": "three", "task": "sort"}).status_code == 201  # room again
        assert c.post("/api/runs/nobody/stop").status_code == 404
        running = [lab.procs[n] for n in ("two", "three")]
        assert all(p.poll() is None for p in running)
    assert all(p.poll() is not None for p in running)  # the lab's end stopped them
    saved = json.loads((tmp_path / "runs" / "two" / "lab.json").read_text())
    assert saved["task"] == "copy" and saved["train"]["max_time"] == LabLimits().max_time
    assert (tmp_path / "runs" / ".data" / "copy" / "src.train").is_file()


def test_files_task_holds_out_the_last_lines(tmp_path, waiting):
    src, tgt = tmp_path / "a.txt", tmp_path / "b.txt"
    src.write_text("".join(f"s{i}\n" for i in range(40)))
    tgt.write_text("".join(f"t{i}\n" for i in range(40)))
    lab = Lab(tmp_path / "runs", files=lab_runs.files_task(str(src), str(tgt)))
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        assert "files" in [t["name"] for t in c.get("/api/lab").json()["tasks"]]
        assert c.post("/api/runs", json={"name": "mine", "task": "files"}).status_code == 201
    data = tmp_path / "runs" / ".data" / "files"
    assert (data / "src.valid").read_text() == "s38\ns39\n"  # 5% of 40 lines
    assert (data / "tgt.train").read_text().splitlines() == [f"t{i}" for i in range(38)]
    with pytest.raises(QkvError, match="give both --src-valid and --tgt-valid"):
        lab_runs.files_task(str(src), str(tgt), str(src))


def test_metrics_from_since_complete_lines_only(client, tmp_path):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "lab.json").write_text(json.dumps({"name": "old", "task": "copy", "preset": "transformer"}))
    (run / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.0}\n{"step": 50, "train_loss": 1.0}\n{"step": 1')
    r = client.get("/api/runs/old/metrics").json()
    assert [x["step"] for x in r["records"]] == [1, 50] and r["next"] == 2 and r["status"] == "empty"
    assert client.get("/api/runs/old/metrics?since=1").json()["records"] == [{"step": 50, "train_loss": 1.0}]
    assert client.get("/api/runs/old/metrics?since=-1").status_code == 422
    assert [x["name"] for x in client.get("/api/runs").json()["runs"]] == ["old"]


def fixture_run(root: Path, name: str, checkpoint: str) -> None:
    run = root / name
    run.mkdir(parents=True)
    shutil.copytree(FIXTURES / checkpoint, run / "last")
    (run / "lab.json").write_text(json.dumps({"name": name, "task": "copy", "preset": "x"}))


def test_inside_a_transformer_every_layer_and_head(client, tmp_path):
    from qkv.frontends import load

    fixture_run(tmp_path / "runs", "tr", "translate-transformer")
    r = client.post("/api/runs/tr/inside", json={"text": "red cat"})
    assert r.status_code == 200, r.json()
    d = r.json()
    translator = load(FIXTURES / "translate-transformer")
    assert d["output"] == translator.translate(["red cat"], beam_size=1)[0]
    cfg = translator.model.cfg
    for kind, n_layers in (("encoder", cfg.n_encoder_layers), ("decoder_self", cfg.n_decoder_layers),
                           ("cross", cfg.n_decoder_layers)):
        maps = d["attention"]["weights"][kind]
        assert len(maps) == n_layers and all(len(layer) == cfg.n_heads for layer in maps)
        for row in maps[-1][0]:
            assert abs(sum(row) - 1) < 1e-4
    assert "hidden" not in d
    assert client.post("/api/runs/tr/inside", json={"text": "x" * 51}).status_code == 413
    assert client.post("/api/runs/tr/inside", json={"text": "  "}).status_code == 422


def test_inside_a_recurrent_model_attention_and_hidden_norms(client, tmp_path):
    import torch

    from qkv.frontends import load

    fixture_run(tmp_path / "runs", "lstm", "translate-lstm-general")
    d = client.post("/api/runs/lstm/inside", json={"text": "red cat"}).json()
    translator = load(FIXTURES / "translate-lstm-general")
    src = translator.tokenizers.src.encode(["red cat"])[0] + [3]  # pieces + EOS
    hidden = d["hidden"]
    assert len(hidden["tokens"]) == len(hidden["norms"]) == len(src)
    # by hand: the encoder's states for the source, one norm per position
    model = translator.model
    with torch.inference_mode():
        states, _ = model.encoder(model.src_embed(torch.tensor([src])), torch.tensor([len(src)]))
    assert hidden["norms"] == pytest.approx(states[0].norm(dim=-1).tolist(), rel=1e-5)
    cross = d["attention"]["weights"]["cross"]
    assert len(cross) == 1 and len(cross[0]) == 1  # one alignment matrix: one layer, one head
    assert all(abs(sum(row) - 1) < 1e-4 for row in cross[0][0])


def test_inside_without_a_checkpoint_says_so(client, tmp_path):
    run = tmp_path / "runs" / "new"
    run.mkdir(parents=True)
    (run / "lab.json").write_text(json.dumps({"name": "new", "task": "copy", "preset": "x"}))
    r = client.post("/api/runs/new/inside", json={"text": "abc"})
    assert r.status_code == 422 and "has no checkpoint yet" in r.json()["error"]


def test_page_inlines_the_panels_fragment(tmp_path):
    fragment = tmp_path / "panels.html"
    fragment.write_text('<section id="panel-demo">demo</section>')
    assert '<section id="panel-demo">demo</section>' in page_html(fragment)
    assert MARKER not in page_html(fragment) and MARKER not in page_html(None)
    lab = Lab(tmp_path / "runs")
    page = TestClient(create_app(lab, panels=fragment), base_url=LOCAL).get("/")
    assert page.status_code == 200 and 'id="panel-demo"' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from outside


def test_a_real_run_trains_stops_on_request_and_is_an_ordinary_run_dir(tmp_path):
    """qkv train in a child process: validation records come, stop commits last/, qkv translate reads it."""
    from qkv.cli import main

    lab = Lab(tmp_path / "runs", LabLimits(max_time=300))
    with TestClient(create_app(lab, panels=None), base_url=LOCAL) as c:
        body = {"name": "t", "task": "copy", "model": {"d_model": 32, "n_heads": 2, "d_ff": 64}}
        assert c.post("/api/runs", json=body).status_code == 201
        deadline = time.monotonic() + 240
        while not any("valid_exact" in r for r in c.get("/api/runs/t/metrics").json()["records"]):
            assert c.get("/api/runs").json()["runs"][0]["status"] == "training", lab.log_tail("t")
            assert time.monotonic() < deadline, lab.log_tail("t")
            time.sleep(0.5)
        assert c.post("/api/runs/t/stop").status_code == 200
        lab.procs["t"].wait(120)
        info = c.get("/api/runs").json()["runs"][0]
        assert info["status"] == "stopped" and info["checkpoint"], lab.log_tail("t", 20)
        records = c.get("/api/runs/t/metrics").json()["records"]
        assert {"train_loss", "lr", "grad_norm"} <= set(records[0])  # the first update's record
        assert any("valid_exact" in r for r in records)
        # the first validation comes early (update 25, first_eval), not at the first eval_every (100): a
        # curve point within seconds of the first update
        first, valid = records[0], next(r for r in records if "valid_exact" in r)
        assert first["step"] == 1 and valid["step"] == 25
        assert valid["time"] - first["time"] < 10, (first, valid)
        assert "interrupted at step" in lab.log_tail("t", 20)  # SIGTERM: the trainer saved and said so
    assert main(["translate", str(tmp_path / "runs" / "t" / "last"), "abc", "--beam-size", "1"]) == 0


def test_cli_names_missing_files(capsys):
    from qkv.cli import main

    assert main(["lab", "--src-train", "a.txt"]) == 2
    assert "give both --src-train and --tgt-train" in capsys.readouterr().err
    assert main(["lab", "--src-train", "/nonexistent/a", "--tgt-train", "/nonexistent/b"]) == 2
    assert "--src-train /nonexistent/a: no such file" in capsys.readouterr().err

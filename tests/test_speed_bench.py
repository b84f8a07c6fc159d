"""benchmarks/speed.py end to end at tiny shapes (--quick): the qkv workers always, the peers
(Hugging Face transformers, CTranslate2) only where the optional ``bench`` extra is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SPEED = Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"


def run_quick(tmp_path: Path, systems: str) -> dict:
    out = tmp_path / "speed.json"
    proc = subprocess.run([sys.executable, str(SPEED), "--quick", "--threads", "1", "--systems", systems,
                           "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "median [min-max]" in proc.stdout and "MFU" in proc.stdout
    return json.loads(out.read_text())


def check_rows(res: dict, expected: set[tuple[str, str]]) -> None:
    rows = {(r["task"], r["system"]): r for r in res["rows"]}
    assert set(rows) == expected
    for (task, _), r in rows.items():
        assert not r["errors"], r["errors"]
        assert r["value"]["min"] <= r["value"]["median"] <= r["value"]["max"] and r["value"]["median"] > 0
        assert r["peak_rss_mb"] > 0
        if task == "train":
            assert r["train_flops_per_token"] > 0 and r["mfu"] > 0


def test_quick_qkv_only(tmp_path):
    res = run_quick(tmp_path, "qkv")
    check_rows(res, {("train", "qkv"), ("greedy", "qkv"), ("beam", "qkv")})
    assert res["matmul_peak_gflops"]["median"] > 0 and res["matmul"][0]["when"] == "start"
    assert "transformer_flops" in res["flop_formula"]
    spec = res["specs"]["tiny"]
    assert spec["decode"]["beam_size"] == 5 and spec["train"]["label_smoothing"] == 0.1
    assert res["meta"]["threads"] == 1 and res["ratios"] == []


def test_quick_with_peers(tmp_path):
    pytest.importorskip("transformers", reason="peers not installed: pip install -c constraints.txt -e '.[bench]'")
    pytest.importorskip("ctranslate2", reason="peers not installed: pip install -c constraints.txt -e '.[bench]'")
    res = run_quick(tmp_path, "qkv,hf,torchnn,ct2-f32,ct2-int8,ct2-f32-par")
    check_rows(res, {("train", "qkv"), ("train", "hf"), ("train", "torchnn"), ("greedy", "qkv"), ("greedy", "hf"),
                     ("greedy", "ct2-f32"), ("greedy", "ct2-int8"), ("beam", "qkv"), ("beam", "hf"),
                     ("beam", "ct2-f32"), ("beam", "ct2-int8"), ("greedy", "ct2-f32-par"),
                     ("beam", "ct2-f32-par")})
    ct2 = [r for r in res["raw"] if r["system"].startswith("ct2-")]
    assert ct2 and not any(r["torch_imported"] for r in ct2)  # the CTranslate2 workers never import torch
    assert {(e["task"], e["peer"]) for e in res["ratios"]} >= {("train", "hf"), ("greedy", "ct2-f32")}


def test_decode_speed_quick(tmp_path):
    """benchmarks/decode_speed.py on the fixture checkpoint: every cell timed on both engines."""
    pytest.importorskip("ctranslate2", reason="CTranslate2 not installed: pip install -c constraints.txt -e '.[export]'")
    fixture = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "translate-transformer"
    out = tmp_path / "decode.json"
    script = SPEED.parent / "decode_speed.py"
    proc = subprocess.run([sys.executable, str(script), "--model", str(fixture), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| qkv / CT2 |" in proc.stdout
    res = json.loads(out.read_text())
    cells = {(r["beam"], r["batch"], r["dtype"]) for r in res["rows"]}
    assert cells == {(b, n, d) for b in (1, 5) for n in (32, 1) for d in ("float32", "int8")}
    for r in res["rows"]:
        assert r["qkv"]["output_tokens"] > 0 and r["ct2"]["output_tokens"] > 0
        assert r["qkv_vs_ct2"] == pytest.approx(r["ct2"]["seconds"] / r["qkv"]["seconds"])
        assert r["ct2"]["translators_in_process"] == 1  # each CTranslate2 translator alone in its process
    assert res["checks"] == []  # one thread only: nothing to compare


def test_decode_speed_checks_that_two_threads_are_not_slower_than_one():
    sys.path.insert(0, str(SPEED.parent))
    try:
        from decode_speed import thread_checks
    finally:
        sys.path.remove(str(SPEED.parent))

    def row(threads, seconds, beam=1):
        return {"name": "m", "beam": beam, "batch": 1, "dtype": "float32", "threads": threads,
                "ct2": {"seconds": seconds}}
    checks = thread_checks([row(1, 1.0), row(2, 0.6), row(1, 1.0, 5), row(2, 1.2, 5), row(2, 9.0, 4)])
    assert [(c["cell"], c["ok"]) for c in checks] == [("m beam1 b1 float32", True), ("m beam5 b1 float32", False)]


def test_serve_models_quick(tmp_path):
    """benchmarks/serve_models.py: one model, then two, behind qkv serve --engine ctranslate2."""
    pytest.importorskip("ctranslate2", reason="CTranslate2 not installed: pip install -c constraints.txt -e '.[export]'")
    model = tmp_path / "model"  # a copy: the conversion is cached beside the checkpoint
    shutil.copytree(Path(__file__).resolve().parent / "fixtures" / "default-task", model)
    src = tmp_path / "src.txt"
    src.write_text("seven\nforty-two\nthree hundred twelve\n", encoding="utf-8")
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(SPEED.parent / "serve_models.py"), "--model", str(model), "--src", str(src),
                           "--threads", "1", "--rounds", "1", "--requests", "16", "--concurrency", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| threads | one model |" in proc.stdout
    row = json.loads(out.read_text())["rows"][0]
    assert set(row["rps"]) == {"one", "a_loaded", "b_loaded", "a_at_once", "b_at_once"}
    assert all(v > 0 for v in row["rps"].values())
    assert row["a_loaded_vs_one"] == pytest.approx(row["rps"]["a_loaded"] / row["rps"]["one"])

"""benchmarks/race_fairseq.py's matching and reading, without fairseq: the command it gives fairseq
sets the recipe's model and optimization, and the logs and outputs fairseq writes are read right."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import race_fairseq  # noqa: E402

from qkv.config import load_toml  # noqa: E402


def flags(argv: list) -> dict[str, str]:
    argv = [str(a) for a in argv]
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out[a] = "" if nxt.startswith("--") else nxt
    return out


def test_fairseq_gets_the_recipes_model_and_optimization(tmp_path):
    cfg = load_toml(str(ROOT / "recipes" / "multi30k" / "en-de.toml"))
    m, t = cfg["model"], cfg["train"]
    f = flags(race_fairseq.fairseq_args(argparse.Namespace(work=str(tmp_path), interval=100), seed=2))
    for flag, key in (("--encoder-layers", "n_encoder_layers"), ("--decoder-layers", "n_decoder_layers"),
                      ("--encoder-embed-dim", "d_model"), ("--encoder-ffn-embed-dim", "d_ff"),
                      ("--encoder-attention-heads", "n_heads"), ("--dropout", "dropout"),
                      ("--attention-dropout", "attention_dropout")):
        assert float(f[flag]) == float(m[key]), flag
    assert int(f["--max-tokens"]) == t["max_tokens"] and float(f["--label-smoothing"]) == t["label_smoothing"]
    assert "--share-all-embeddings" in f and f["--seed"] == "2"
    assert f["--save-interval-updates"] == f["--validate-interval-updates"] == "100"
    # fairseq's inverse_sqrt (lr·min(step/warmup, sqrt(warmup/step)), from 0) against the paper's
    # formula that qkv trains with: d^-0.5·min(step^-0.5, step·warmup^-1.5), times lr_scale
    peak, warmup = float(f["--lr"]), int(f["--warmup-updates"])
    assert warmup == t["warmup_steps"] and float(f["--warmup-init-lr"]) == 0
    for step in (1, 10, 500, 1000, 1001, 4000, 20000):
        paper = t["lr_scale"] * m["d_model"] ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        assert peak * min(step / warmup, math.sqrt(warmup / step)) == pytest.approx(paper, rel=1e-7)


def test_fairseq_logs_are_read_in_nats_and_its_outputs_in_order(tmp_path):
    run = tmp_path / "run-1"
    (run / "qkv").mkdir(parents=True)
    (run / "qkv" / "metrics.jsonl").write_text(
        json.dumps({"step": 50, "tokens_per_s": 2000.0}) + "\n" + json.dumps({"step": 100, "valid_nll": 6.0}) + "\n")
    (run / "fairseq.log").write_text(
        '2026-11-26 05:28:31 | INFO | train_inner | {"epoch": 1, "loss": "12.1", "wps": "1600", "num_updates": "50"}\n'
        '2026-11-26 05:28:37 | INFO | valid | {"epoch": 1, "valid_nll_loss": "8.5", "valid_num_updates": "100"}\n'
        '2026-11-26 05:29:00 | INFO | train | {"epoch": 1, "train_wpb": "3445", "train_num_updates": "139"}\n'
        "a line that is not a record\n")
    c = race_fairseq.curves(run)
    assert c["qkv"]["valid_nll"] == {100: 6.0} and c["qkv"]["tokens_per_s"] == 2000.0
    assert c["fairseq"]["valid_nll"] == {100: pytest.approx(8.5 * math.log(2))}  # bits -> nats
    assert c["fairseq"]["tokens_per_s"] == 1600.0 and c["fairseq"]["tokens_per_update"] == 3445.0
    gen = tmp_path / "gen.out"
    gen.write_text("S-1\tb\nH-1\t-0.5\tB\nD-1\t-0.5\tZwei\nD-0\t-0.4\tEins\t mit Tab\n"
                   "2026 | INFO | Translated 2 sentences (5 tokens) in 0.1s\n")
    assert race_fairseq.fairseq_hyps(gen) == ["Eins\t mit Tab", "Zwei"]


def test_speed_takes_the_last_checkpoint_within_the_window(tmp_path, monkeypatch, capsys):
    import os

    run = tmp_path / "run-3"
    (run / "qkv").mkdir(parents=True)
    (run / "fairseq").mkdir()
    t0 = 1_000_000.0
    (run / "race.json").write_text(json.dumps({"started": t0, "commit": "abc1234"}))
    for update, seconds in ((100, 150), (200, 300), (300, 650)):
        step = run / "qkv" / f"step_{update:06d}"
        step.mkdir()
        (step / "model.safetensors").write_bytes(b"x")
        os.utime(step / "model.safetensors", (t0 + seconds, t0 + seconds))
    for update, seconds in ((100, 200), (200, 500)):
        ckpt = run / "fairseq" / f"checkpoint_1_{update}.pt"
        ckpt.write_bytes(b"x")
        os.utime(ckpt, (t0 + seconds, t0 + seconds))
    (run / "qkv" / "metrics.jsonl").write_text(json.dumps({"step": 50, "tokens_per_s": 2000.0}) + "\n")
    (run / "fairseq.log").write_text(
        '0 | INFO | train_inner | {"wps": "1000", "num_updates": "50"}\n'
        '0 | INFO | train | {"train_wpb": "3000", "train_num_updates": "139"}\n')
    monkeypatch.setattr(race_fairseq, "qkv_tokens_per_update", lambda run_dir: 3000.0)
    race_fairseq.speed(argparse.Namespace(work=str(tmp_path), run=3, within=600))
    out = capsys.readouterr().out
    # within 600 s: qkv's update 200 at 300 s (0.667/s), fairseq's 200 at 500 s (0.4/s): 1.67×
    assert "qkv: 200 updates in 300 s = 0.667 updates/s, 2,000 target tokens/s" in out
    assert "fairseq: 200 updates in 500 s = 0.400 updates/s, 1,200 target tokens/s" in out
    assert "qkv vs fairseq: 1.67× (its own logs: 2.00×; run 3, commit abc1234)" in out

"""Recurrent models through the unchanged pipeline: ``qkv train --arch lstm``, checkpoints, ``qkv.load``,
translate, int8, info, viz; ``--tokenizer-from``; a tiny attention LSTM learns word reversal."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import qkv
from qkv.cli import main

WORDS = ["red", "blue", "cat", "dog", "sun", "tree", "big", "old"]


def reversal(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        out.append((" ".join(words), " ".join(reversed(words))))
    return out


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rnn")
    train, valid = reversal(1000, 0), reversal(40, 1)
    return {
        "dir": d,
        "argv": ["--src-train", write(d / "train.src", [s for s, _ in train]),
                 "--tgt-train", write(d / "train.tgt", [t for _, t in train]),
                 "--src-valid", write(d / "valid.src", [s for s, _ in valid]),
                 "--tgt-valid", write(d / "valid.tgt", [t for _, t in valid])],
        "valid": valid,
    }


FLAGS = ["--preset", "tiny", "--d-model", "48", "--n-encoder-layers", "1", "--n-decoder-layers", "1",
         "--tokenizer", "bpe", "--vocab-size", "60", "--max-tokens", "200", "--max-len", "30", "--schedule", "constant",
         "--lr", "0.003", "--label-smoothing", "0", "--eval-bleu-samples", "40", "--threads", "1"]


@pytest.fixture(scope="module")
def lstm_run(data, capsys_module=None):
    out = data["dir"] / "lstm"
    rc = main(["train", *data["argv"], *FLAGS, "--arch", "lstm", "--attention", "additive",
               "--max-steps", "200", "--eval-every", "200", "--out", str(out)])
    assert rc == 0
    return out


def test_attention_lstm_learns_reversal_and_round_trips(lstm_run, data):
    record = [json.loads(line) for line in (lstm_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["valid_exact"] >= 0.7, record  # greedy, held-out reversals
    model = qkv.load(lstm_run / "best")
    assert type(model.model).__name__ == "RNNSeq2Seq" and model.model.cfg.arch == "lstm"
    src = [s for s, _ in data["valid"]]
    greedy, beam = model.translate(src, beam_size=1), model.translate(src, beam_size=4)
    refs = [t for _, t in data["valid"]]
    assert sum(h == r for h, r in zip(greedy, refs)) / len(refs) == pytest.approx(record["valid_exact"])
    assert sum(h == r for h, r in zip(beam, refs)) >= 0.7 * len(refs)
    # int8: nn.LSTM and the linear layers quantised dynamically, still translating
    q = qkv.load(lstm_run / "best", quantize="int8")
    assert "Quantized" in type(q.model.encoder.rnn).__name__ or "quantized" in type(q.model.encoder.rnn).__module__
    assert sum(h == r for h, r in zip(q.translate(src, beam_size=1), refs)) >= 0.6 * len(refs)


def test_info_viz_and_translate_cli_on_an_rnn(lstm_run, tmp_path, capsys):
    assert main(["info", str(lstm_run / "best")]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in qkv.load(lstm_run / "best").model.parameters())
    assert "attention additive" in out and f"{n:,}" in out and "FLOPs formula is the encoder-decoder Transformer's" in out
    assert main(["info", "--arch", "gru", "--attention", "none", "--preset", "small"]) == 0
    assert "gru: hidden=256" in capsys.readouterr().out
    prefix = tmp_path / "att"
    assert main(["viz", "attention", str(lstm_run / "best"), "red cat sun", "--out", str(prefix)]) == 0
    assert (tmp_path / "att.png").is_file() and (tmp_path / "att.html").is_file()
    capsys.readouterr()
    assert main(["translate", str(lstm_run / "best"), "red cat sun"]) == 0
    assert capsys.readouterr().out.strip() == "sun cat red"


def test_context_vector_model_trains_and_viz_says_it_has_no_attention(data, tmp_path, capsys):
    out = tmp_path / "gru-none"
    rc = main(["train", *data["argv"], *FLAGS, "--arch", "gru", "--attention", "none", "--max-steps", "10",
               "--eval-every", "10", "--eval-bleu-samples", "2", "--out", str(out)])
    assert rc == 0
    assert qkv.load(out / "best").model.cfg.attention == "none"
    capsys.readouterr()
    rc = main(["viz", "attention", str(out / "best"), "red cat", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "no attention" in err and "context vector" in err and "Traceback" not in err


def test_tokenizer_from_reuses_the_subword_model(data, lstm_run, tmp_path, capsys):
    out = tmp_path / "reuse"
    rc = main(["train", *data["argv"], *FLAGS, "--arch", "rnn", "--rnn-nonlinearity", "relu", "--attention", "dot",
               "--max-steps", "5", "--eval-every", "5", "--eval-bleu-samples", "0", "--vocab-size", "999",
               "--tokenizer-from", str(lstm_run / "best"), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert (out / "best" / "spm.model").read_bytes() == (lstm_run / "best" / "spm.model").read_bytes()
    out2 = tmp_path / "reuse-file"
    assert main(["train", *data["argv"], *FLAGS, "--max-steps", "2", "--eval-every", "2", "--eval-bleu-samples",
                 "0", "--tokenizer-from", str(lstm_run / "best" / "spm.model"), "--out", str(out2)]) == 0
    assert (out2 / "best" / "spm.model").read_bytes() == (lstm_run / "best" / "spm.model").read_bytes()
    capsys.readouterr()
    rc = main(["train", *data["argv"], *FLAGS, "--tokenizer-from", str(tmp_path / "nope"), "--out", str(tmp_path / "z")])
    err = capsys.readouterr().err
    assert rc == 2 and "nope" in err and "no such tokenizer" in err


def test_bad_rnn_flags_name_the_field(data, tmp_path, capsys):
    for flags, field in ((["--arch", "cnn"], "'arch'"), (["--arch", "lstm", "--attention", "bilinear"], "'attention'"),
                         (["--arch", "rnn", "--rnn-nonlinearity", "sigmoid"], "'rnn_nonlinearity'"),
                         (["--schedule", "cosine"], "'schedule'")):
        capsys.readouterr()
        rc = main(["train", *data["argv"], *FLAGS, *flags, "--out", str(tmp_path / "bad")])
        err = capsys.readouterr().err
        assert rc == 2 and field in err and "Traceback" not in err, (flags, err)
        assert not (tmp_path / "bad").exists()

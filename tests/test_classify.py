"""Classification end to end: a tiny encoder learns a synthetic sentiment task from the CLI;
``qkv classify`` and ``qkv evaluate``; pooling ignores padding; bad input names file and line;
the metrics against hand-computed values."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.config import ModelConfig
from qkv.metrics import accuracy, confusion_matrix, f1_per_class, format_confusion, macro_f1
from qkv.models import build_model

GOOD = ["great", "good", "superb", "fun"]
BAD = ["awful", "bad", "boring", "dull"]
NEUTRAL = ["the", "movie", "plot", "actor", "was", "and", "a", "film", "story"]

FLAGS = ["--task", "classify", "--preset", "tiny", "--tokenizer", "bpe", "--vocab-size", "60", "--max-tokens", "512",
         "--warmup-steps", "30", "--lr-scale", "2", "--label-smoothing", "0", "--threads", "1"]


def review(rng: random.Random, positive: bool) -> str:
    words = [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 10))]
    words.insert(rng.randint(0, len(words)), rng.choice(GOOD if positive else BAD))
    return " ".join(words)


def write_jsonl(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        pos = rng.random() < 0.5
        rows.append(json.dumps({"text": review(rng, pos) + (" <br />" if rng.random() < 0.2 else ""),
                                "label": "pos" if pos else "neg"}))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("classify")
    train = write_jsonl(d / "train.jsonl", 400, 1)
    valid = write_jsonl(d / "valid.jsonl", 60, 2)
    test = write_jsonl(d / "test.jsonl", 80, 3)
    code, _, err = cli("train", *FLAGS, "--pooling", "mean", "--train", str(train), "--valid", str(valid),
                       "--max-steps", "150", "--eval-every", "75", "--out", str(d / "run"))
    assert code == 0, err
    return {"dir": d, "train": train, "valid": valid, "test": test, "model": d / "run" / "best", "log": err}


def test_learns_synthetic_task_from_cli(run):
    assert "accuracy" in run["log"]
    records = [json.loads(line) for line in (run["dir"] / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("valid_accuracy", 0) for r in records) >= 0.9
    train_records = [r for r in records if "train_loss" in r]
    assert train_records and all("examples_per_s" in r and "tokens_per_s" not in r for r in train_records)
    model = qkv.load(run["model"])
    assert model.labels == ["neg", "pos"]
    (label, p), (label2, _) = model.classify(["the movie was great and fun", "the plot was awful and dull"])
    assert (label, label2) == ("pos", "neg") and 0.5 < p <= 1.0


def test_classify_command_args_file_and_empty_line(run, tmp_path):
    code, out, _ = cli("classify", str(run["model"]), "a superb film", "a boring film")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split("\t")[0] == "pos" and lines[1].split("\t")[0] == "neg"
    assert 0.5 < float(lines[0].split("\t")[1]) <= 1.0
    f = tmp_path / "in.txt"
    f.write_text("a superb film\n\na boring film\n", encoding="utf-8")
    code, out, _ = cli("classify", str(run["model"]), "--input", str(f))
    assert code == 0
    lines = out.split("\n")
    assert lines[0].startswith("pos\t") and lines[1] == "" and lines[2].startswith("neg\t")  # empty stays empty


def test_evaluate_reports_accuracy_f1_confusion(run):
    code, out, err = cli("evaluate", str(run["model"]), "--test", str(run["test"]))
    assert code == 0, err
    assert "accuracy" in out and "macro-F1" in out and "true\\pred" in out
    acc = float(out.split("accuracy")[1].split()[0])
    assert acc >= 0.9


def test_info_on_a_classifier_counts_parameters_without_the_translation_flops(run):
    import qkv

    code, out, err = cli("info", str(run["model"]))
    assert code == 0, err
    n_params = sum(p.numel() for p in qkv.load(run["model"]).model.parameters())
    assert "(classify)" in out and f"{n_params:,}" in out
    assert "not computed for a classify transformer model" in out and "MFLOP" not in out


def test_mean_and_cls_pooling_ignore_padding():
    torch.manual_seed(0)
    for pooling in ("mean", "cls"):
        cfg = ModelConfig(task="classify", pooling=pooling, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                          dropout=0.0, attention_dropout=0.0, src_vocab_size=30, tgt_vocab_size=30, n_classes=3)
        model = build_model(cfg).eval()
        x = torch.tensor([[4, 9, 10, 11]])
        padded = torch.tensor([[4, 9, 10, 11, 0, 0, 0]])
        assert torch.allclose(model(x), model(padded), atol=1e-5)
        assert torch.allclose(model.embed(x), model.embed(padded), atol=1e-5)
    # the mean is over valid positions only: checked against a hand-made mean
    h = torch.randn(1, 7, 16)
    from qkv.models.encoder_only import mean_pool

    assert torch.allclose(mean_pool(h, padded != 0), h[:, :4].mean(dim=1))


def test_metrics_hand_computed():
    golds = [0, 0, 0, 1, 1, 2]
    preds = [0, 1, 0, 1, 2, 2]
    m = confusion_matrix(golds, preds, 3)
    assert m == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert accuracy(golds, preds) == pytest.approx(4 / 6)
    # class 0: P = 2/2, R = 2/3 -> F1 = 0.8; class 1: P = 1/2, R = 1/2 -> 0.5; class 2: P = 1/2, R = 1 -> 2/3
    assert f1_per_class(m) == pytest.approx([0.8, 0.5, 2 / 3])
    assert macro_f1(m) == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert "true\\pred" in format_confusion(m, ["a", "b", "c"])


# --- bad input ---------------------------------------------------------------------------------------

def bad(tmp_path: Path, name: str, content: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content)
    return p


@pytest.mark.parametrize("name,content,message", [
    ("missing.jsonl", b'{"text": "a"}\n', "missing.jsonl:1: no field 'label'"),
    ("notjson.jsonl", b'{"text": "a", "label": "x"}\nnot json\n', "notjson.jsonl:2: not a JSON object"),
    ("empty.jsonl", b'{"text": "a", "label": "x"}\n{"text": "  <br />", "label": "y"}\n', "empty.jsonl:2: empty text"),
    ("utf8.jsonl", b'{"text": "a", "label": "x"}\n{"text": "\xff", "label": "y"}\n', "utf8.jsonl:2: invalid UTF-8"),
    ("cols.tsv", b"text\tlabel\na\tx\nb\n", "cols.tsv:3: 1 tab-separated columns"),
    ("header.tsv", b"sentence\tlabel\na\tx\n", "header.tsv:1: the TSV header has no column 'text'"),
])
def test_bad_training_files(tmp_path, name, content, message):
    path = bad(tmp_path, name, content)
    code, _, err = cli("train", *FLAGS, "--train", str(path), "--out", str(tmp_path / "r"))
    assert code == 2 and message in err, err
    assert not (tmp_path / "r").exists()


def test_unknown_valid_label_names_line(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", 20, 1)
    valid = bad(tmp_path, "valid.jsonl", b'{"text": "a b", "label": "pos"}\n{"text": "c d", "label": "meh"}\n')
    code, _, err = cli("train", *FLAGS, "--train", str(train), "--valid", str(valid), "--out", str(tmp_path / "r"))
    assert code == 2 and "valid.jsonl:2: label 'meh' does not occur in the training data" in err


def test_tsv_and_single_label_and_task_flags(tmp_path):
    tsv = bad(tmp_path, "t.tsv", b"label\ttext\npos\ta great film\nneg\ta bad film\n")
    code, _, err = cli("train", *FLAGS, "--train", str(tsv), "--max-steps", "2", "--out", str(tmp_path / "r"))
    assert code == 0, err
    one = bad(tmp_path, "one.jsonl", b'{"text": "a", "label": "x"}\n{"text": "b", "label": "x"}\n')
    code, _, err = cli("train", *FLAGS, "--train", str(one), "--out", str(tmp_path / "r1"))
    assert code == 2 and "at least 2 labels" in err
    code, _, err = cli("train", "--task", "classify", "--out", str(tmp_path / "r2"))
    assert code == 2 and "--train" in err
    code, _, err = cli("train", *FLAGS, "--pooling", "last", "--train", str(tsv), "--out", str(tmp_path / "r3"))
    assert code == 2 and "pooling" in err
    code, _, err = cli("train", "--task", "sing", "--train", str(tsv), "--out", str(tmp_path / "r4"))
    assert code == 2 and "'task'" in err


def test_classify_with_a_translation_model_is_refused(tmp_path):
    code, _, err = cli("classify", str(tmp_path / "nope"), "text")
    assert code == 2 and "not found" in err


# --- recurrent classifiers -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch,pooling,bidirectional", [("lstm", "mean", True), ("gru", "last", True),
                                                        ("rnn", "last", False)])
def test_rnn_pooling_ignores_padding_and_last_is_the_final_states(arch, pooling, bidirectional):
    torch.manual_seed(0)
    cfg = ModelConfig(task="classify", arch=arch, pooling=pooling, bidirectional=bidirectional, d_model=8,
                      n_encoder_layers=2, dropout=0.0, src_vocab_size=20, tgt_vocab_size=20, n_classes=2)
    model = build_model(cfg).eval()
    x = torch.tensor([[4, 8, 9, 10], [4, 11, 0, 0]])
    padded = torch.cat([x, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    assert torch.allclose(model(x), model(padded), atol=1e-6)
    assert torch.allclose(model(x)[1], model(x[1:, :2])[0], atol=1e-6)  # as if alone, unpadded
    if pooling == "last":
        # the final states of the top layer of torch's own module, run on each sequence alone
        with torch.no_grad():
            emb = model.src_embed(x[1:, :2])
            _, state = model.encoder(emb, None)
        h = state.h.view(2, 2 if bidirectional else 1, 1, 8)[-1]  # (dirs, 1, H): top layer
        expected = torch.cat(list(h), dim=-1)  # [forward; backward]
        out, lengths = model.encode(x)
        assert torch.allclose(model.pool(out, x, lengths)[1], expected[0], atol=1e-6)


def test_bilstm_learns_from_cli(run, tmp_path):
    flags = [f for f in FLAGS if f not in ("--lr-scale", "2")]
    code, _, err = cli("train", *flags, "--arch", "lstm", "--pooling", "mean", "--d-model", "32",
                       "--train", str(run["train"]), "--valid", str(run["valid"]), "--max-steps", "150",
                       "--eval-every", "150", "--schedule", "constant", "--lr", "0.01", "--out", str(tmp_path / "r"))
    assert code == 0, err
    model = qkv.load(tmp_path / "r" / "best")
    data = [json.loads(x) for x in run["test"].read_text().splitlines()]
    preds = model.classify([d["text"] for d in data])
    acc = sum(p == d["label"] for (p, _), d in zip(preds, data)) / len(data)
    assert acc >= 0.9


def test_translate_with_a_classifier_is_a_clear_error(run):
    code, _, err = cli("translate", str(run["model"]), "a superb film")
    assert code == 2 and "'classify' model, not a translation model" in err


def test_truncate_head_and_head_plus_tail_hand_computed():
    from qkv.tasks.classify import truncate
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 99], [1, 2, 99]]
    assert truncate(rows, 6, [99]) == ([[1, 2, 3, 4, 5, 99], [1, 2, 99]], 1)
    assert truncate(rows, 6, [99], tail=3) == ([[1, 2, 3, 7, 8, 99], [1, 2, 99]], 1)  # 3 head, 3 tail (with [SEP])
    assert truncate([[1, 2, 3, 4, 5]], 3, (), tail=1) == ([[1, 2, 5]], 1)
    with pytest.raises(ValueError):
        truncate(rows, 6, [99], tail=6)


def test_keep_tail_reads_a_verdict_at_the_end_in_training_and_at_classify_time(tmp_path):
    """Long reviews whose only sentiment word is the last: with max_len 8, the head alone holds no
    signal (chance), head + tail (keep_tail 3) holds it, and the saved model truncates the same way."""
    rng = random.Random(5)

    def write(path: Path, n: int) -> Path:
        rows = []
        for _ in range(n):
            pos = rng.random() < 0.5
            words = [rng.choice(NEUTRAL) for _ in range(rng.randint(12, 20))] + [rng.choice(GOOD if pos else BAD)]
            rows.append(json.dumps({"text": " ".join(words), "label": "pos" if pos else "neg"}))
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
        return path

    train, valid = write(tmp_path / "train.jsonl", 400), write(tmp_path / "valid.jsonl", 80)
    models = {}
    for tail in (0, 3):
        out = tmp_path / f"tail{tail}"
        code, _, err = cli("train", *FLAGS, "--pooling", "mean", "--max-len", "8",
                           "--keep-tail", str(tail), "--train", str(train), "--valid", str(valid),
                           "--max-steps", "150", "--eval-every", "150", "--out", str(out))
        assert code == 0, err
        assert (f"first 5 and last 3 of max_len=8" if tail else "first max_len=8 tokens") in err
        models[tail] = json.loads((out / "best" / "config.json").read_text())["train"]["keep_tail"], \
            qkv.load(out / "best")
    assert models[0][0] == 0 and models[3][0] == 3
    texts = [json.loads(line)["text"] for line in valid.read_text().splitlines()]
    labels = [json.loads(line)["label"] for line in valid.read_text().splitlines()]
    right = {t: sum(p[0] == y for p, y in zip(m.classify(texts), labels)) / len(texts) for t, (_, m) in models.items()}
    assert right[3] >= 0.9 > 0.75 >= right[0], right
    # the frontend cuts as training did: the last token of a long text is read with keep_tail only
    enc = models[3][1]
    ids = enc.tokenizers.src.encode([texts[0]])[0]
    assert enc.input_tokens(texts[0])[0, 1:].tolist() == ids[:5] + ids[-3:]


def test_evaluate_reports_progress_batch_by_batch(run):
    """``qkv evaluate --test`` on a long file shows a progress bar (on a terminal): the classifier
    reports each batch it has done, and the batches add up to every text."""
    enc = qkv.load(run["model"])
    rows = [json.loads(line) for line in run["test"].read_text().splitlines()]
    enc.batch_size = 16
    done: list[int] = []
    report = enc.evaluate([r["text"] for r in rows], [r["label"] for r in rows], on_batch=done.append)
    assert sum(done) == len(rows) and len(done) == -(-len(rows) // 16)
    assert report.preds == enc.probabilities([r["text"] for r in rows]).argmax(dim=-1).tolist()

"""The lm task: perplexity by hand, BPTT batches in order with the state carried, and the CLI
(train a tiny char LM on a repetitive text in seconds, evaluate, generate streamed)."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.cli import main
from qkv.config import EOS, MODEL_PRESETS, TrainConfig
from qkv.data.tokenizer import TokenizerPair
from qkv.models.decoder_only import DecoderOnlyTransformer
from qkv.models.rnn_lm import RNNLanguageModel
from qkv.tasks.base import TextData
from qkv.frontends import LanguageModel
from qkv.tasks.lm import LmTask

LINES = ["the cat sat", "on the mat", "", "the end"]


def tokenizers():
    return TokenizerPair.train(LINES, LINES, 100, "char", True, specials=True)


def tiny(kind, vocab):
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], task="lm", arch=kind, src_vocab_size=vocab, tgt_vocab_size=vocab)
    return (DecoderOnlyTransformer(cfg) if kind == "transformer" else RNNLanguageModel(cfg)).eval()


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_perplexity_is_exp_of_mean_nll_by_hand(kind):
    tok = tokenizers()
    model = tiny(kind, tok.tgt.vocab_size)
    window = 5
    lm = LanguageModel(model, tok, TrainConfig(max_len=window, max_tokens=10_000))
    result = lm.score(LINES)
    stream = []
    for ids in tok.tgt.encode(LINES):
        stream += ids + [EOS]
    # by hand: the Transformer sees non-overlapping windows of 5; the LSTM (one row: the stream is
    # shorter than 10000 / 5 rows... of at least 6 tokens) reads the whole stream with its state carried
    x = torch.tensor(stream)
    nll, n = 0.0, 0
    if kind == "transformer":
        w = (len(stream) - 1) // window
        for i in range(w):
            seg = x[i * window : (i + 1) * window + 1]
            logp = F.log_softmax(model(seg[None, :-1])[0], -1)
            nll -= logp.gather(1, seg[1:, None]).sum().item()
            n += window
    else:
        rows = len(stream) // (window + 1)
        per = len(stream) // rows
        for r in range(rows):
            seg = x[r * per : (r + 1) * per]
            logits, _ = model(seg[None, :-1])
            nll -= F.log_softmax(logits[0], -1).gather(1, seg[1:, None]).sum().item()
            n += per - 1
    assert result.tokens == n
    assert result.ppl == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert result.bpc == pytest.approx(nll / math.log(2) / sum(len(s) + 1 for s in LINES), rel=1e-4)


def test_bptt_batches_are_contiguous_and_in_order():
    tok = tokenizers()
    task = LmTask()
    task.recurrent = True
    split = task.encode(TextData(LINES * 20), tok, TrainConfig(max_len=4), print, train=True)
    order = split.batches(8, shuffle=True, seed=1, epoch=3)  # 2 rows; shuffle is ignored for an RNN
    assert order == [[k] for k in range(len(order))]
    batches = [split.collate(ix) for ix in order]
    assert batches[0].first and not any(b.first for b in batches[1:])
    rows = torch.cat([b.inputs for b in batches], 1)
    targets = torch.cat([b.targets for b in batches], 1)
    assert torch.equal(rows[:, 1:], targets[:, :-1])  # each row reads on where the last window stopped
    stream = torch.tensor(split.stream)
    per = len(split.stream) // 2
    assert torch.equal(rows[1], stream[per : per + rows.size(1)])


def test_rnn_state_is_carried_across_windows():
    """The summed loss over the BPTT windows equals one pass over each row (the state carries)."""
    tok = tokenizers()
    model = tiny("gru", tok.tgt.vocab_size)
    task = LmTask()
    task.recurrent = True
    split = task.encode(TextData(LINES * 5), tok, TrainConfig(max_len=4), print, train=True)
    cfg = TrainConfig(label_smoothing=0.0)
    with torch.no_grad():
        total = sum(float(task.loss(model, split.collate(ix), cfg)[1]) for ix in split.batches(8, False, 0, 0))
        rows = split._rows
        logits, _ = model(rows[:, :-1])
    whole = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1), reduction="sum")
    assert total == pytest.approx(float(whole), rel=1e-5)


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("arch,tokenizer", [("transformer", "char"), ("gru", "char"), ("transformer", "bpe")])
def test_cli_a_tiny_lm_learns_a_repetitive_text(tmp_path, capsys, arch, tokenizer):
    text = write(tmp_path / "abc.txt", "*** START OF IT ***\n" + "abcd efg\n" * 300 + "*** END OF IT ***\nlicence\n")
    out = tmp_path / "run"
    rc = main(["train", "--task", "lm", "--arch", arch, "--train", text, "--strip-gutenberg", "--valid-fraction", "0.1",
               "--out", str(out), "--preset", "tiny", "--tokenizer", tokenizer, "--vocab-size", "40",
               "--max-len", "32", "--max-tokens", "256",
               "--schedule", "inverse_sqrt", "--lr", "0.01", "--warmup-steps", "10", "--max-steps", "120",
               "--eval-every", "120", "--label-smoothing", "0", "--threads", "1"])
    assert rc == 0
    capsys.readouterr()
    assert main(["evaluate", str(out / "best"), "--test", text, "--strip-gutenberg"]) == 0
    report = capsys.readouterr().out
    ppl = float(report.split("perplexity")[1].split()[0])
    assert ppl < 1.3, report  # the text is deterministic after its first characters
    assert "bits per character" in report
    # a subword prompt should end at a word boundary: "abcd e" would be cut into pieces ("▁e") that
    # training never saw before "fg" (the text always has "▁efg")
    prefix = "abcd e" if tokenizer == "char" else "abcd"
    assert main(["generate", str(out / "best"), "--prefix", prefix, "--max-new-tokens", "12", "--greedy"]) == 0
    generated = capsys.readouterr().out
    assert generated.startswith("abcd efg\nabcd efg"), generated


def test_cli_lm_errors_are_clear(tmp_path, capsys):
    text = write(tmp_path / "plain.txt", "no markers here\n" * 10)
    rc = main(["train", "--task", "lm", "--train", text, "--strip-gutenberg", "--out", str(tmp_path / "r")])
    assert rc == 2
    assert "plain.txt: no line starting with '*** START'" in capsys.readouterr().err
    rc = main(["train", "--task", "lm", "--train", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "r")])
    assert rc == 2 and "missing.txt" in capsys.readouterr().err

"""Forced decoding (qkv score, Translator.score): the log-probability of given targets."""

import dataclasses
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.data.batching import collate
from qkv.decoding import banned_ids, beam_search, max_output_len
from qkv.decoding.batch import decode_sentences
from qkv.decoding.forced import forced_logprobs
from qkv.errors import QkvError

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
SOURCES = ["red cat", "the big dog sun", "small tree", "blue"]


@pytest.mark.parametrize("name", ["translate-transformer", "translate-lstm-general", "prefix_lm-transformer"])
def test_forced_scores_are_the_beam_search_log_probabilities(name):
    """Each beam output, fed back as a target, gets its beam ``logprob`` (EOS included), to 1e-5:
    beam search sums in float64, and computes the same step logits in other batch shapes (float32
    rounding ~1e-7 a token); these untrained models emit outputs of up to 60 tokens."""
    model = qkv.load(FIXTURES / name)
    src = model.tokenizers.src.encode(SOURCES)
    hyps = decode_sentences(model.model, src, dataclasses.replace(model.decode_cfg, beam_size=4, nbest=3))
    pairs = [(s, h) for s, nbest in zip(src, hyps) for h in nbest]
    scores = forced_logprobs(model.model, [s for s, _ in pairs], [h.tokens for _, h in pairs])
    for (_, h), lp in zip(pairs, scores):
        assert len(lp) == len(h.tokens) + 1
        assert sum(lp) == pytest.approx(h.logprob, abs=1e-5)


@pytest.mark.parametrize("name,norm,limits", [
    ("translate-transformer", "gnmt", {"max_len_a": 1.0, "max_len_b": 8}),
    ("translate-transformer", "length", {"max_len_a": 0.0, "max_len_b": 3}),
    ("translate-transformer", "gnmt", {"min_len": 4, "max_len_a": 0.0, "max_len_b": 2}),
    ("translate-lstm-general", "length", {"max_len_a": 0.0, "max_len_b": 5}),
    ("prefix_lm-transformer", "gnmt", {"max_len_a": 0.0, "max_len_b": 5})])
def test_greedy_answers_carry_the_log_probability_forced_scoring_gives(name, norm, limits):
    """A greedy answer's ``logprob`` is the sum of its tokens' forced log-probabilities (EOS included;
    where the limit forced EOS, even before min_len, the model's own log p(EOS) there), to 1e-4; its
    ``score`` is what a beam search of one beam reports, ``logprob / lp(|Y|)`` with |Y| counting
    EOS: ((5 + |Y|) / 6)^alpha (gnmt) or |Y|^alpha (length). Untrained models: most outputs run to
    their limit. translate_scored and translate_rich report them; translate() gives the same texts."""
    model = qkv.load(FIXTURES / name)
    src = model.tokenizers.src.encode(SOURCES)
    lp_of = (lambda n: ((5 + n) / 6) ** 0.6) if norm == "gnmt" else (lambda n: n ** 0.6)
    cfg = dataclasses.replace(model.decode_cfg, beam_size=1, nbest=1, length_penalty=0.6, length_norm=norm, **limits)
    hyps = [h[0] for h in decode_sentences(model.model, src, cfg)]
    forced = forced_logprobs(model.model, src, [h.tokens for h in hyps])
    for h, lp in zip(hyps, forced):
        assert h.logprob == pytest.approx(sum(lp), abs=1e-4) and h.logprob < 0
        assert h.score == pytest.approx(h.logprob / lp_of(len(h.tokens) + 1), rel=1e-9)
    budget = max_output_len(torch.tensor([len(s) + 1 for s in src]), cfg.max_len_a, cfg.max_len_b)
    one = beam_search(model.model, collate(src, None).src, 1, 0.6, budget, min_len=cfg.min_len, length_norm=norm,
                      banned=banned_ids(model.tokenizers.tgt))
    for h, b in zip(hyps, one):
        assert (h.tokens, h.score, h.logprob) == (b[0].tokens, pytest.approx(b[0].score, abs=1e-4),
                                                  pytest.approx(b[0].logprob, abs=1e-4))
    kw = dict(beam_size=1, length_penalty=0.6, length_norm=norm, **limits)
    scored = [s[0] for s in model.translate_scored(SOURCES, **kw)]
    rich = [r[0] for r in model.translate_rich(SOURCES, alignments=False, **kw)]
    assert model.translate(SOURCES, **kw) == [text for text, _ in scored] == [r["text"] for r in rich]
    for h, (_, score), r in zip(hyps, scored, rich):
        assert score == r["score"] == pytest.approx(h.score, abs=1e-9)
        assert r["logprob"] == pytest.approx(sum(r["token_logprobs"]), abs=1e-4)


def test_forced_scores_are_teacher_forced_log_softmax():
    """Against the model's own teacher-forced forward pass: log_softmax(logits)[target], EOS last."""
    model = qkv.load(FIXTURES / "translate-transformer")
    src, tgt = model.tokenizers.src.encode(["red cat"]), model.tokenizers.tgt.encode(["cat red"])
    lp = forced_logprobs(model.model, src, tgt)[0]
    from qkv.data.batching import collate

    batch = collate(src, tgt)
    with torch.no_grad():
        ref = torch.log_softmax(model.model(batch.src, batch.tgt_in).float(), -1)[0]
    expected = ref.gather(1, batch.tgt_out[0].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lp), expected, rtol=0, atol=1e-5)


def test_score_command(tmp_path, capsys):
    src, tgt, out = tmp_path / "s.txt", tmp_path / "t.txt", tmp_path / "scores.txt"
    src.write_text("red cat\nsmall tree\n")
    tgt.write_text("cat red\n\n")  # an empty target: only EOS is scored
    model = FIXTURES / "translate-transformer"
    assert main(["score", str(model), "--src", str(src), "--tgt", str(tgt), "--output", str(out)]) == 0
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert len(rows) == 2 and len(rows[1][1].split()) == 1
    for total, per_token in rows:
        assert float(total) == pytest.approx(sum(map(float, per_token.split())), abs=1e-5)
        assert float(total) < 0
    expected = qkv.load(model).score(["red cat", "small tree"], ["cat red", ""])
    assert [float(t) for t, _ in rows] == pytest.approx([sum(lp) for lp in expected], abs=1e-5)
    assert "mean log-probability" in capsys.readouterr().err


def test_score_refuses_what_it_cannot_score(tmp_path, capsys):
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("red cat\nsmall tree\n")
    tgt.write_text("cat red\n")
    for argv, needle in [
        (["score", str(FIXTURES / "translate-transformer"), "--src", str(src), "--tgt", str(tgt)], "has 2 lines"),
        (["score", str(FIXTURES / "classify-transformer"), "--src", str(src), "--tgt", str(src)],
         "not a translation model"),
        (["score", str(FIXTURES / "translate-transformer"), "--src", str(src), "--tgt", str(src), "--device",
          "cuda"] if not torch.cuda.is_available() else ["score", "nowhere", "--src", str(src), "--tgt", str(src)],
         "no CUDA GPU" if not torch.cuda.is_available() else "nowhere"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


def test_translate_on_a_device_by_name(capsys):
    assert main(["translate", str(FIXTURES / "translate-transformer"), "red cat", "--device", "auto"]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert main(["translate", str(FIXTURES / "translate-transformer"), "red cat", "--device", "tpu9"]) == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["translate-transformer", "translate-lstm-general", "prefix_lm-transformer"])
def test_target_prefix_forces_the_start_and_the_search_goes_on(name):
    """Greedy decoding with its own first k tokens as the prefix gives the same output; any prefix
    starts every output; each continuation token is the argmax of the model given the prefix."""
    model = qkv.load(FIXTURES / name)
    free = model.hypotheses(SOURCES, beam_size=1)
    tgt = model.tokenizers.tgt
    for k in (1, 3):
        prefix = tgt.decode([free[0][0].tokens[:k]])[0]
        ids = tgt.encode([prefix])[0]
        forced = model.hypotheses(SOURCES[:1], target_prefix=prefix, beam_size=1)[0][0]
        assert forced.tokens[: len(ids)] == ids
        if ids == free[0][0].tokens[:k]:  # the prefix re-tokenizes as it was produced
            assert forced.tokens == free[0][0].tokens
    for nbest in model.hypotheses(SOURCES, target_prefix="dog", beam_size=3, nbest=2):
        for h in nbest:
            assert h.tokens[: len(tgt.encode(["dog"])[0])] == tgt.encode(["dog"])[0]


def test_jsonl_output_has_scores_token_logprobs_and_alignments(tmp_path):
    import json

    out = tmp_path / "out.jsonl"
    model = FIXTURES / "translate-transformer"
    assert main(["translate", str(model), "red cat", "", "small tree", "--output-format", "jsonl", "--beam-size", "2",
                 "--nbest", "2", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3] and rows[1]["hypotheses"] == []
    src_len = len(qkv.load(model).tokenizers.src.encode(["red cat"])[0])
    for h in rows[0]["hypotheses"]:
        assert len(h["token_logprobs"]) == len(h["tokens"]) + 1
        assert sum(h["token_logprobs"]) == pytest.approx(h["logprob"], abs=1e-3)
        pairs = [tuple(map(int, p.split("-"))) for p in h["alignment"].split()]
        assert [j for _, j in pairs] == list(range(len(h["tokens"])))
        assert all(0 <= i < src_len for i, _ in pairs)
    text = qkv.load(model).translate_scored(["red cat"], beam_size=2, nbest=2)[0]
    assert [h["text"] for h in rows[0]["hypotheses"]] == [t for t, _ in text]


def test_score_takes_the_pieces_of_translate_jsonl_and_gives_the_beam_logprob(tmp_path):
    """``qkv score --tgt-format jsonl`` scores every hypothesis of ``qkv translate --output-format
    jsonl`` by its own pieces: each total is that hypothesis's beam ``logprob`` (EOS included)."""
    import json

    src, hyp, out = tmp_path / "s.txt", tmp_path / "hyp.jsonl", tmp_path / "scores.txt"
    src.write_text("red cat\n\nthe big dog sun\nsmall tree\n")  # the empty line has no hypotheses
    model = FIXTURES / "translate-transformer"
    assert main(["translate", str(model), "--input", str(src), "--output-format", "jsonl", "--beam-size", "4",
                 "--nbest", "3", "--output", str(hyp)]) == 0
    logprobs = [h["logprob"] for line in hyp.read_text().splitlines() for h in json.loads(line)["hypotheses"]]
    assert len(logprobs) == 9
    assert main(["score", str(model), "--src", str(src), "--tgt", str(hyp), "--tgt-format", "jsonl",
                 "--output", str(out)]) == 0
    totals = [float(row.split("\t")[0]) for row in out.read_text().splitlines()]
    assert totals == pytest.approx(logprobs, abs=1e-4)


def test_pieces_are_scored_as_given_not_re_segmented(tmp_path):
    """Pieces that are not the tokenizer's segmentation of their text ('▁ ▁ c a t' reads 'cat',
    which is '▁ c a t') score as those pieces, by the API and by ``--tgt-format pieces``."""
    model = qkv.load(FIXTURES / "translate-transformer")
    tgt = model.tokenizers.tgt
    pieces = ["▁", "▁", "c", "a", "t"]
    assert tgt.piece_ids(pieces, "here") == [4, 4, 19, 12, 14] and tgt.encode(["cat"]) == [[4, 19, 12, 14]]
    want = forced_logprobs(model.model, model.tokenizers.src.encode(["red cat"]), [[4, 4, 19, 12, 14]])
    got = model.score(["red cat"], [pieces])
    assert got[0] == pytest.approx(want[0], abs=1e-6) and len(got[0]) == 6
    assert sum(got[0]) != pytest.approx(sum(model.score(["red cat"], ["cat"])[0]), abs=1e-3)
    src, tgt_file, out = tmp_path / "s.txt", tmp_path / "t.txt", tmp_path / "scores.txt"
    src.write_text("red cat\n")
    tgt_file.write_text(" ".join(pieces) + "\n")
    assert main(["score", str(FIXTURES / "translate-transformer"), "--src", str(src), "--tgt", str(tgt_file),
                 "--tgt-format", "pieces", "--output", str(out)]) == 0
    assert float(out.read_text().split("\t")[0]) == pytest.approx(sum(want[0]), abs=1e-5)


def test_score_names_the_line_of_a_bad_piece_or_jsonl_line(tmp_path, capsys):
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("red cat\nsmall tree\n")
    model = str(FIXTURES / "translate-transformer")
    for fmt, text, needle in [
        ("pieces", "▁ c a t\n▁ Z\n", f"{tgt}:2: 'Z' is not a piece of this tokenizer"),
        ("pieces", "▁ </s>\n▁\n", f"{tgt}:1: '</s>' is a special piece"),
        ("jsonl", '{"hypotheses": []}\nnot json\n', f"{tgt}:2: not a line of qkv translate --output-format jsonl"),
        ("jsonl", '{"hypotheses": [{"text": "x"}]}\n{"hypotheses": []}\n', f"{tgt}:1: not a line of qkv translate"),
    ]:
        tgt.write_text(text)
        assert main(["score", model, "--src", str(src), "--tgt", str(tgt), "--tgt-format", fmt]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    with pytest.raises(QkvError, match="target 2: 'Z' is not a piece"):
        qkv.load(model).score(["red cat", "tree"], [["▁", "c"], ["▁", "Z"]])

"""--engine ctranslate2: CTranslate2 decodes behind the translation front-end, with qkv's options.

The reference is qkv's own engine on the same checkpoint and inputs (``--engine qkv``). Greedy
outputs must be identical strings; beam search (under --length-norm length --early-stopping, the
rule CTranslate2 has) identical on the trained default-task model, scores within 0.01: CTranslate2's
log-probabilities leave out the special tokens neither engine emits (the converted model's -1e4
bias), qkv's keep them in the softmax, a difference of log(1 - p(special)) per token. On the
untrained fixture checkpoints the specials hold much of the probability, so their beam outputs are
compared on the trained model only. The cache tests count conversions (``convert``) and read the
converted model's modification time. Needs the export extra; skipped without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qkv
from qkv.cli import main
from qkv.engines import cache
from qkv.engines import translator as engine
from qkv.export.optional import INSTALL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                                reason=f"ctranslate2 is not installed: {INSTALL}")

FIXTURES = Path(__file__).parent / "fixtures"
UNTRAINED = FIXTURES / "checkpoints" / "translate-transformer"
TRAINED = FIXTURES / "default-task"  # the embedded default task's model: number words -> German
WORDS = ["red cat", "the big dog sun", "small tree", "blue", "red red red blue green cat dog tree sun big small the"]
NUMBERS = ["three hundred twenty-one", "nine thousand nine hundred ninety-nine", "seven", "forty-two",
           "eleven hundred", "six hundred six", "five million and one", "twelve"]
BEAM = ["--beam-size", "4", "--length-norm", "length", "--early-stopping"]


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "user-cache"))
    return tmp_path / "user-cache"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Copies of the two checkpoints (the conversion cache is written beside them), loaded both ways."""
    root = tmp_path_factory.mktemp("engine")
    shutil.copytree(UNTRAINED, root / "untrained")
    shutil.copytree(TRAINED, root / "trained")
    return root


@pytest.fixture(scope="module")
def pair(ckpts):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = qkv.load(ckpts / name), qkv.load(ckpts / name, engine="ctranslate2", threads=1)
        return loaded[name]
    return get


def translate(capsys, *argv: str) -> list[str]:
    capsys.readouterr()
    rc = main(["translate", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out.splitlines()


def refused(capsys, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    line = err.splitlines()[-1]
    assert line.startswith(f"qkv {argv[0]}: error: "), err
    for needle in needles:
        assert needle in line, line
    return line


# --- the same outputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,sentences", [("untrained", WORDS), ("trained", NUMBERS)])
@pytest.mark.parametrize("flags", [[], ["--max-len-a", "0.5", "--max-len-b", "3"], ["--min-len", "6"],
                                   ["--target-prefix", "s"]])
def test_greedy_translate_is_identical(ckpts, capsys, name, sentences, flags):
    """``qkv translate --engine ctranslate2`` prints what ``--engine qkv`` prints, the length rules included
    (the untrained model runs every output to its limit, a·|x| + b per sentence in one batch)."""
    argv = [str(ckpts / name), "--beam-size", "1", *flags, *sentences]
    want = translate(capsys, *argv)
    assert translate(capsys, *argv, "--engine", "ctranslate2", "--threads", "1") == want
    assert len(want) == len(sentences) and any(want)


@pytest.mark.parametrize("nbest", [1, 2])
@pytest.mark.parametrize("limits", [[], ["--max-len-a", "0.5", "--max-len-b", "2"]])
def test_beam_search_is_identical_with_length_norm_length_and_early_stopping(ckpts, capsys, nbest, limits):
    """(With the tight limits most outputs end at their own sentence's limit, below the batch's longest.)"""
    argv = [str(ckpts / "trained"), *BEAM, "--nbest", str(nbest), *limits, *NUMBERS]
    want = [line.split("\t") for line in translate(capsys, *argv)]
    got = [line.split("\t") for line in translate(capsys, *argv, "--engine", "ctranslate2")]
    assert [[w[0], w[-1]] for w in want] == [[g[0], g[-1]] for g in got]  # line index and text
    if nbest > 1:
        assert [float(g[1]) for g in got] == pytest.approx([float(w[1]) for w in want], abs=0.01)


def test_nbest_as_wide_as_the_beam_agrees_on_the_best_and_on_shared_scores(pair):
    """With n-best = beam size, the lists may differ below the best: the two searches keep different
    candidates once hypotheses end. The best is the same; a hypothesis found by both scores the same."""
    ours, theirs = pair("trained")
    kw = dict(beam_size=4, nbest=4, length_norm="length", early_stopping=True)
    for a, b in zip(ours.translate_scored(NUMBERS, **kw), theirs.translate_scored(NUMBERS, **kw)):
        assert a[0][0] == b[0][0]
        # two token sequences may detokenize to one text ("zwölf" whole or in pieces): each text's best
        best_a, best_b = ({}, {})
        for hyps, best in ((a, best_a), (b, best_b)):
            for text, score in hyps:
                best.setdefault(text, score)
        shared = best_a.keys() & best_b.keys()
        assert [best_a[t] for t in shared] == pytest.approx([best_b[t] for t in shared], abs=0.01)


@pytest.mark.parametrize("beam", [1, 4])
def test_rich_output_prefix_scores_and_alignments_agree(pair, beam):
    """translate_rich (``--output-format jsonl``, the server): the same tokens, alignments (from CTranslate2's
    attention: its last layer's mean over heads, as qkv's), token log-probabilities within 0.01, score and
    logprob within 0.01 a token, with and without a target prefix (a beam with a prefix: length penalty 0).
    The best hypothesis is the same; below it, what both searches found agrees."""
    ours, theirs = pair("trained")
    for prefix, kw in [(None, dict(length_penalty=0.6)), ("drei", dict(length_penalty=0.0))]:
        kw = dict(kw, beam_size=beam, nbest=min(beam, 2), length_norm="length", early_stopping=True)
        a, b = ours.translate_rich(NUMBERS, target_prefix=prefix, **kw), theirs.translate_rich(NUMBERS, target_prefix=prefix, **kw)
        for x, y in zip(a, b):
            assert len(x) == len(y)
            # below the best the two searches may keep different candidates (CTranslate2 ranks by
            # probabilities renormalised over the ids qkv never emits): qkv's k-th is at least as good,
            # and what both found agrees in every field
            for h, g in zip(x, y):  # (within 0.01 a token, as the log-probabilities below)
                assert h["score"] >= g["score"] - 0.01 * len(g["token_logprobs"])
            found = {tuple(h["tokens"]): h for h in x}
            assert tuple(y[0]["tokens"]) == tuple(x[0]["tokens"])
            for g in y:
                h = found.get(tuple(g["tokens"]))
                if h is None:
                    continue
                assert (g["text"], g["tokens"], g["alignment"]) == (h["text"], h["tokens"], h["alignment"])
                assert g["token_logprobs"] == pytest.approx(h["token_logprobs"], abs=0.01)
                # with length penalty 0 a score is a sum of log-probabilities: 0.01 a token, as logprob
                assert g["score"] == pytest.approx(h["score"], abs=0.01 * len(h["token_logprobs"]))
                assert g["logprob"] == pytest.approx(h["logprob"], abs=0.01 * len(h["token_logprobs"]))
            if prefix:
                assert all(g["text"].startswith("drei") for g in y)


@pytest.mark.parametrize("kw", [{}, {"max_len_a": 0.0, "max_len_b": 1}, {"target_prefix": "drei"}])
def test_greedy_answers_carry_their_log_probability(pair, kw):
    """Greedy answers report the log-probability of their tokens after the prefix and EOS (EOS forced
    at the limit, as qkv's search does): the sum of CTranslate2's own forced log-probabilities to
    1e-4, qkv's engine's within 0.01 a token; the score is logprob / lp(|Y|), as a beam of one
    gives it (the model's saved gnmt norm, alpha 0.6). (The limit of one token cuts most outputs.)"""
    ours, theirs = pair("trained")
    prefix = theirs.tokenizers.tgt.encode([kw["target_prefix"]])[0] if "target_prefix" in kw else []
    a, b = ours.hypotheses(NUMBERS, beam_size=1, **kw), theirs.hypotheses(NUMBERS, beam_size=1, **kw)
    src = theirs.tokenizers.src.encode(NUMBERS)
    forced = theirs.forced(src, [h[0].tokens for h in b])
    whole = [len(h[0].tokens) for h in theirs.hypotheses(NUMBERS, beam_size=1)]
    cut = 0
    for x, y, lp, n in zip(a, b, forced, whole):
        h, g = x[0], y[0]
        assert g.tokens == h.tokens
        assert g.logprob == pytest.approx(sum(lp[len(prefix):]), abs=1e-4) and g.logprob < 0
        assert g.logprob == pytest.approx(h.logprob, abs=0.01 * len(lp))
        assert g.score == pytest.approx(g.logprob / ((5 + len(g.tokens) - len(prefix) + 1) / 6) ** 0.6, rel=1e-9)
        cut += len(g.tokens) < n
    if kw.get("max_len_b") == 1:
        assert cut >= 5


def test_sentences_at_their_limit_are_searched_again_in_one_call_per_limit(pair):
    """With limits tight enough that most beam searches reach them: one translate_batch call for the
    batch, one more for each distinct limit that changed a search, one score_batch call; the answers
    are those of each such sentence searched alone with its limit and each hypothesis a limit ended
    scored alone (tokens equal, scores to 1e-4: other batch shapes round differently)."""
    import random

    ours, theirs = pair("trained")
    words = ("one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred "
             "thousand million and").split()
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(48)]
    cfg = dataclasses.replace(theirs.decode_cfg, beam_size=4, nbest=2, length_norm="length", early_stopping=True,
                              max_len_a=0.5, max_len_b=1, batch_size=16)
    src = theirs.tokenizers.src.encode(sentences)
    before = dict(theirs.ct2.calls)
    got = theirs.search(src, [], cfg)
    calls = {name: n - before[name] for name, n in theirs.ct2.calls.items()}
    budgets = theirs.budgets(src, [], cfg)
    sources = [theirs.pieces(s) for s in src]
    wide = theirs.decode_batch(sources, None, max(budgets), cfg)
    again = theirs.limited(wide, budgets)
    assert sum(map(len, again.values())) >= 10 and len(again) >= 2  # the case at hand
    assert calls == {"translate_batch": 1 + len(again), "score_batch": 1}
    alone_cfg = dataclasses.replace(cfg, batch_size=1)
    for i, r in enumerate(wide):  # the reference: sentence by sentence
        limit = max(budgets)
        if i in again.get(budgets[i], []):
            r, limit = theirs.decode_batch([sources[i]], None, budgets[i], alone_cfg)[0], budgets[i]
        hyps = [[theirs.tgt_ids[p] for p in h] for h in r.hypotheses]
        forced = {k: theirs.forced([src[i]], [h])[0] for k, h in enumerate(hyps) if len(h) >= limit}
        want = theirs.ranked(hyps, r.scores, forced, [], cfg)
        assert [h.tokens for h in got[i]] == [h.tokens for h in want]
        assert [v for h in got[i] for v in (h.score, h.logprob)] == \
            pytest.approx([v for h in want for v in (h.score, h.logprob)], abs=1e-4)
    # and qkv's engine, on these limits, gives the same best outputs
    mine = ours.hypotheses(sentences, **{k: getattr(cfg, k) for k in ("beam_size", "nbest", "length_norm",
                                                                    "early_stopping", "max_len_a", "max_len_b")})
    same = sum(m[0].tokens == g[0].tokens for m, g in zip(mine, got))
    assert same >= 0.9 * len(sentences)


def test_scores_of_given_targets_and_alignments_agree(pair):
    ours, theirs = pair("trained")
    targets = ["dreihunderteinundzwanzig", "neun", "sieben", "zweiundvierzig"]
    got, want = theirs.score(NUMBERS[:4], targets), ours.score(NUMBERS[:4], targets)
    assert [len(g) for g in got] == [len(w) for w in want]
    assert [v for g in got for v in g] == pytest.approx([v for w in want for v in w], abs=0.01)
    src, tgt = ours.tokenizers.src.encode(NUMBERS[:4]), ours.tokenizers.tgt.encode(targets)
    assert [theirs.alignment(s, t) for s, t in zip(src, tgt)] == [ours.alignment(s, t) for s, t in zip(src, tgt)]


def test_int8_compute_type_translates(ckpts, capsys):
    out = translate(capsys, str(ckpts / "trained"), "--beam-size", "1", "--engine", "ctranslate2", "--int8", *NUMBERS)
    assert len(out) == len(NUMBERS) and out[0] == "dreihunderteinundzwanzig"


# --- what CTranslate2 cannot do as qkv does: refused by name ---------------------------------------

def test_options_ctranslate2_cannot_honour_are_refused_by_name(ckpts, capsys, pair):
    ckpt = str(ckpts / "trained")
    base = ["translate", ckpt, "--engine", "ctranslate2", "seven"]
    refused(capsys, base, "--length-norm gnmt", "--engine qkv")  # the model's saved settings: beam 4, gnmt
    refused(capsys, [*base, "--length-norm", "length"], "--early-stopping")
    refused(capsys, [*base, *BEAM, "--target-prefix", "drei"], "--target-prefix", "--length-penalty 0")
    refused(capsys, [*base, "--ensemble", ckpt], "--ensemble", "--engine ctranslate2")
    refused(capsys, ["translate", str(FIXTURES / "checkpoints" / "prefix_lm-transformer"), "--engine", "ctranslate2",
                     "x"], "'prefix_lm'", "--engine qkv")
    refused(capsys, ["translate", str(FIXTURES / "checkpoints" / "translate-lstm-general"), "--engine",
                     "ctranslate2", "x"], "'lstm'", "--engine qkv")
    refused(capsys, ["translate", str(FIXTURES / "checkpoints" / "lm-transformer"), "--engine", "ctranslate2", "x"],
            "not a translation model")
    with pytest.raises(qkv.errors.QkvError, match="--engine qkv"):
        pair("trained")[1].translate_rich(["seven"], beam_size=1, attention=True)
    with pytest.raises(qkv.errors.QkvError, match="--engine 'onnx'"):
        qkv.load(ckpt, engine="onnx")


def test_without_the_package_the_error_names_the_extra(ckpts, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails as if it were not installed
    refused(capsys, ["translate", str(ckpts / "trained"), "--engine", "ctranslate2", "--beam-size", "1", "seven"],
            "--engine ctranslate2 needs the ctranslate2 package", INSTALL)


# --- the conversion cache --------------------------------------------------------------------------

@pytest.fixture
def counted(monkeypatch):
    """The number of conversions run so far."""
    calls = []
    convert = cache.convert
    monkeypatch.setattr(cache, "convert", lambda *a: (calls.append(a), convert(*a)))
    return calls


def caches(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.name.startswith(("ct2-", ".ct2-")))


def rewrite(ckpt: Path, name: str, text: str) -> None:
    """Change one file of a checkpoint and its manifest entry, as a new save would."""
    (ckpt / name).write_text(text, encoding="utf-8")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_converted_once_then_reused_and_reconverted_when_the_checkpoint_changes(tmp_path, counted):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    first = cache.converted(ckpt, log=lambda m: None)
    assert len(counted) == 1 and caches(ckpt) == [first] and (first / cache.MARKER).is_file()
    mtime = (first / "model.bin").stat().st_mtime_ns
    assert qkv.load(ckpt, engine="ctranslate2").translate(["seven"], beam_size=1) == ["sieben"]
    assert cache.converted(ckpt) == first
    assert len(counted) == 1 and (first / "model.bin").stat().st_mtime_ns == mtime
    config = json.loads((ckpt / "config.json").read_text())
    config["decode"]["beam_size"] = 1
    rewrite(ckpt, "config.json", json.dumps(config))
    second = cache.converted(ckpt, log=lambda m: None)
    assert len(counted) == 2 and second != first and caches(ckpt) == [second]  # the stale one removed


@pytest.mark.parametrize("damage", ["truncated", "no marker", "a file missing"])
def test_a_corrupt_or_half_cache_is_detected_and_rebuilt(tmp_path, counted, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    place = cache.converted(ckpt, log=lambda m: None)
    if damage == "truncated":
        with open(place / "model.bin", "r+b") as f:
            f.truncate(1000)
    elif damage == "no marker":  # as a copy cut short, or a directory of the same name
        (place / cache.MARKER).unlink()
    else:
        (place / "target.spm").unlink()
    notes = []
    assert cache.converted(ckpt, log=notes.append) == place
    assert len(counted) == 2 and cache.is_complete(place, cache.cache_key(ckpt))
    assert any("not a complete conversion" in n for n in notes)
    assert qkv.load(ckpt, engine="ctranslate2").translate(["seven"], beam_size=1) == ["sieben"]


def test_a_conversion_that_fails_leaves_no_cache(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)

    def crash(checkpoint, tmp, key):
        (tmp / "model.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "convert", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.converted(ckpt, log=lambda m: None)
    assert caches(ckpt) == []
    monkeypatch.undo()
    assert cache.is_complete(cache.converted(ckpt, log=lambda m: None), cache.cache_key(ckpt))


def test_a_read_only_checkpoint_is_converted_into_the_user_cache(tmp_path, monkeypatch, user_cache, counted):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    temporary = cache._temporary
    monkeypatch.setattr(cache, "_temporary", lambda parent, key: None if parent == ckpt else temporary(parent, key))
    if os.geteuid() != 0:  # root writes anywhere: there the directory is refused by the patch alone
        ckpt.chmod(0o555)
    notes = []
    try:
        place = cache.converted(ckpt, log=notes.append)
        assert place.parent == user_cache / "ct2" and caches(ckpt) == []
        assert any("cannot be written" in n and str(place) in n for n in notes)
        assert cache.converted(ckpt, log=notes.append) == place and len(counted) == 1
    finally:
        ckpt.chmod(0o755)


def test_a_checkpoint_without_its_manifest_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    shutil.copy(TRAINED / "config.json", tmp_path / "ckpt")
    refused(capsys, ["translate", str(tmp_path / "ckpt"), "--engine", "ctranslate2", "--beam-size", "1", "seven"],
            f"incomplete checkpoint {tmp_path / 'ckpt'} (no manifest.json)")


def test_a_conversion_another_process_finished_first_is_used(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    convert = cache.convert

    def racing(checkpoint, tmp, key):  # another process renames its whole conversion into place meanwhile
        other = ckpt / ".other"
        other.mkdir()
        convert(checkpoint, other, key)
        os.replace(other, ckpt / f"ct2-{key}")
        convert(checkpoint, tmp, key)

    monkeypatch.setattr(cache, "convert", racing)
    place = cache.converted(ckpt, log=lambda m: None)
    assert caches(ckpt) == [place] and cache.is_complete(place, cache.cache_key(ckpt))


def test_temporaries_of_a_killed_conversion_are_removed_at_the_next_one(tmp_path, counted):
    """A conversion killed hard (no chance to clean up) leaves ``.ct2-KEY.tmp-*``; the next conversion
    beside the checkpoint removes those untouched for an hour, and leaves a fresh one (another
    process may be writing it) alone."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    abandoned, fresh = ckpt / ".ct2-0123456789abcdef.tmp-dead", ckpt / ".ct2-0123456789abcdef.tmp-live"
    for d in (abandoned, fresh):
        d.mkdir()
        (d / "model.bin").write_bytes(b"half")
    two_hours_ago = time.time() - 2 * 3600
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    place = cache.converted(ckpt, log=lambda m: None)
    assert caches(ckpt) == [fresh, place] and not abandoned.exists()


# --- checked before the conversion; a cache path in the way ----------------------------------------------

def test_the_decoding_settings_are_checked_before_the_conversion(tmp_path, capsys, counted):
    """The checkpoint's own beam settings (beam 4, --length-norm gnmt, no --early-stopping), which
    CTranslate2 cannot decode as qkv does, are refused before anything is converted or written,
    naming them and what to pass; so are bad flags and --engine-timeout values."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    line = refused(capsys, ["translate", str(ckpt), "--engine", "ctranslate2", "seven"], "--length-norm gnmt",
                   "give --length-norm length --early-stopping, or --beam-size 1, or use --engine qkv",
                   f"({ckpt} saves beam size 4, --length-norm gnmt, no --early-stopping)")
    refused(capsys, ["translate", str(ckpt), "--engine", "ctranslate2", "--length-norm", "length", "seven"],
            "without --early-stopping")
    refused(capsys, ["translate", str(ckpt), "--engine", "ctranslate2", *BEAM, "--target-prefix", "drei", "seven"],
            "--target-prefix", "--length-penalty 0")
    refused(capsys, ["translate", str(ckpt), "--engine", "ctranslate2", "--beam-size", "2", "--nbest", "3", "seven"],
            "nbest")
    refused(capsys, ["translate", str(ckpt), "--engine", "ctranslate2", "--engine-timeout", "0", "seven"],
            "--engine-timeout")
    refused(capsys, ["translate", str(ckpt), "--engine-timeout", "5", "seven"], "--engine-timeout",
            "--engine ctranslate2")
    assert counted == [] and caches(ckpt) == [] and "converting" not in line
    # in a moment: before torch (seconds to import) is loaded, let alone the checkpoint
    code = ("import sys; from qkv.cli import main; rc = main(['translate', sys.argv[1], '--engine', 'ctranslate2', "
            "'seven']); print(rc, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert run.stdout.split() == ["2", "False"] and "--length-norm gnmt" in run.stderr, (run.stdout, run.stderr)
    assert translate(capsys, str(ckpt), "--engine", "ctranslate2", *BEAM, "seven") == ["sieben"]
    assert len(counted) == 1


def test_the_readme_and_inference_page_engine_commands_run_as_written(tmp_path, capsys, monkeypatch, counted):
    """Every `qkv translate ... --engine ctranslate2` command of README.md and docs/inference.md, on the
    trained default-task model in place of the run it names (runs/default/best is that model): each
    translates, or, where the page says it "is refused", is refused before any conversion."""
    import re
    import shlex

    root = Path(__file__).parents[1]
    found = [(m.group(0), text[m.end():].lstrip("`").lstrip().startswith("is refused"))
             for doc in ("README.md", "docs/inference.md")
             for text in [(root / doc).read_text(encoding="utf-8")]
             for m in re.finditer(r"qkv translate runs/\w+/best --engine ctranslate2[^`\n]*", text)]
    assert len(found) >= 4 and sum(r for _, r in found) == 1, found
    ckpt = tmp_path / "runs" / "default" / "best"
    shutil.copytree(TRAINED, ckpt)
    (tmp_path / "test.en").write_text("seven\ntwelve\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for command, is_refused in sorted(found, key=lambda c: not c[1]):  # the refused first: before any conversion
        argv = [str(ckpt) if re.fullmatch(r"runs/\w+/best", a) else a for a in shlex.split(command)[1:]]
        capsys.readouterr()
        if is_refused:
            refused(capsys, argv, "--length-norm gnmt", "--length-norm length --early-stopping")
            assert counted == []
            continue
        assert main(argv) == 0, (command, capsys.readouterr().err)
        out = capsys.readouterr().out.split() or (tmp_path / "test.hyp").read_text(encoding="utf-8").split()
        assert out and set(out) <= {"sieben", "zwölf"}, (command, out)


@pytest.mark.parametrize("where", ["beside the checkpoint", "a link beside it"])
def test_a_file_where_the_cache_should_be_sends_the_conversion_to_the_user_cache(tmp_path, user_cache, where):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    blocker = ckpt / f"ct2-{cache.cache_key(ckpt)}"
    if where == "a link beside it":
        (tmp_path / "elsewhere").write_text("not a conversion")
        blocker.symlink_to(tmp_path / "elsewhere")
    else:
        blocker.write_text("not a conversion")
    notes = []
    place = cache.converted(ckpt, log=notes.append)
    assert place.parent == user_cache / "ct2" and cache.is_complete(place, cache.cache_key(ckpt))
    assert any(f"{blocker} is a file or a link" in n for n in notes), notes
    assert blocker.is_symlink() or blocker.read_text() == "not a conversion"  # left as it was: not qkv's
    assert qkv.load(ckpt, engine="ctranslate2", threads=1).translate(["seven"], beam_size=1) == ["sieben"]
    assert cache.converted(ckpt, log=notes.append) == place  # and found there next time


def test_a_file_as_the_user_cache_too_is_one_line_naming_both(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    (ckpt / f"ct2-{cache.cache_key(ckpt)}").write_text("x")
    (tmp_path / "cache-file").write_text("x")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache-file"))
    refused(capsys, ["translate", str(ckpt), "--engine", "ctranslate2", "--beam-size", "1", "seven"],
            f"cannot write a CTranslate2 conversion of {ckpt} beside it or in {tmp_path / 'cache-file' / 'ct2'}")


def test_a_load_in_process_heals_a_killed_worker(tmp_path):
    """qkv.load(..., engine="ctranslate2"): the worker killed, the next call is answered (by a new one)."""
    import signal

    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    model = qkv.load(ckpt, engine="ctranslate2", threads=1, engine_timeout=30)
    assert model.ct2.timeout == 30 and model.worker_status()["state"] == "ready"
    first = model.ct2.pid
    os.kill(first, signal.SIGKILL)
    end = time.monotonic() + 30
    while model.worker_status()["restarts"] == 0 and time.monotonic() < end:  # (a call sent as it dies fails)
        time.sleep(0.05)
    assert model.translate(["seven"], beam_size=1) == ["sieben"]
    assert model.ct2.pid != first and model.worker_status()["restarts"] == 1
    with pytest.raises(qkv.errors.QkvError, match="engine_timeout"):
        qkv.load(ckpt, engine_timeout=5)
    with pytest.raises(qkv.errors.QkvError, match="--engine-timeout must be a positive number"):
        qkv.load(ckpt, engine="ctranslate2", engine_timeout=0)

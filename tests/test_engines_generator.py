"""The CTranslate2 engine for language models (qkv.engines.generator): greedy tokens equal to qkv's
(the fixture lm checkpoint, a tiny GPT-2 built with transformers' classes and imported), EOS a line
break that generation goes on after, the text streamed in whole characters, int8 greedy agreement
reported, the command's --engine, the server's /generate, what it cannot do refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("ctranslate2", reason="pip install -c constraints.txt -e '.[export]'")

import qkv  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.decoding.greedy import banned_ids  # noqa: E402
from qkv.decoding.sampling import sample  # noqa: E402
from qkv.engines.generator import CT2LanguageModel  # noqa: E402
from qkv.errors import QkvError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
PROMPTS = ["the time", "", "first line\nsecond", "a", "the time traveller was"]


def qkv_greedy(lm, prompt: str, n: int) -> list[int]:
    ids, n = lm.fit_positions(lm.prompt_ids(prompt), n)
    with lm.evaluating():
        return list(sample(lm.model, ids, n, 0.0, banned=banned_ids(lm.tokenizer)))


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    for name in ("lm-transformer", "lm-lstm"):
        shutil.copytree(FIXTURES / name, root / name)
    return root


def test_own_lm_greedy_tokens_and_text_equal_qkv(own):
    ours = qkv.load(own / "lm-transformer")
    theirs = qkv.load(own / "lm-transformer", engine="ctranslate2", threads=1)
    assert isinstance(theirs, CT2LanguageModel)
    for prompt in PROMPTS:
        want = qkv_greedy(ours, prompt, 60)
        assert list(theirs.token_ids(prompt, 60, 0.0)) == want and len(want) == 60
        assert "".join(theirs.generate(prompt, 60, 0.0)) == "".join(ours.generate(prompt, 60, 0.0))
    assert list(theirs.token_ids("the", 0, 0.0)) == []


def test_a_seeded_draw_repeats_in_a_fresh_process(own):
    """CTranslate2 seeds its random generators once per process (``set_random_seed``): the same command
    with --seed draws the same text twice."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "qkv", "generate", str(own / "lm-transformer"), "--prefix", "the", "--seed", "3",
            "--top-k", "5", "--max-new-tokens", "20", "--engine", "ctranslate2", "--threads", "1"]
    runs = [subprocess.run(argv, capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout) > len("the\n")


def test_int8_greedy_agreement_is_reported(own, capsys):
    """CTranslate2's int8 engine against qkv's float greedy tokens: the share of prompts whose first 30
    tokens are all equal, and of equal tokens up to the first difference (printed)."""
    ours = qkv.load(own / "lm-transformer")
    int8 = qkv.load(own / "lm-transformer", engine="ctranslate2", quantize="int8", threads=1)
    prompts = PROMPTS + ["he said", "and then", "it was", "the machine", "we"]
    same, prefix, total = 0, 0, 0
    for p in prompts:
        want, got = qkv_greedy(ours, p, 30), list(int8.token_ids(p, 30, 0.0))
        assert len(got) == 30
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), 30)
        same += n == 30
        prefix += n
        total += 30
    with capsys.disabled():
        print(f"\nlm-transformer fixture, CTranslate2 int8 greedy vs qkv float: {same}/{len(prompts)} prompts "
              f"identical over 30 tokens, {prefix}/{total} tokens before the first difference")
    assert prefix >= 1  # at least the first token of one prompt (int8 moves the logits of a tiny model)


def test_streamed_text_is_whole_characters(own):
    """A byte-level tokenizer's token may end inside a character: the stream holds it back until the
    character is complete, never shows U+FFFD, and adds up to the decoded text."""
    lm = qkv.load(own / "lm-transformer", engine="ctranslate2", threads=1)

    class Bytes:  # a tokenizer whose tokens are single UTF-8 bytes (ids 7 ..)
        vocab_size = 263

        def encode(self, texts):
            return [[7 + b for b in t.encode()] for t in texts]

        def decode(self, rows):
            return [bytes(i - 7 for i in r).decode("utf-8", errors="replace") for r in rows]

    lm.tokenizers.tgt = lm.tokenizers.src = Bytes()
    text = "naïve 💖 東京"
    lm.token_ids = lambda *a, **k: iter(Bytes().encode([text])[0])
    pieces = list(lm.generate("", 100, 0.0))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert "💖" in pieces  # its four bytes shown at once


def test_what_it_cannot_do_is_refused_by_name(own):
    lm = qkv.load(own / "lm-transformer", engine="ctranslate2", threads=1)
    with pytest.raises(QkvError, match="--engine qkv"):
        lm.score(["the time"])
    with pytest.raises(QkvError, match="'lm' model with arch 'lstm'.*--engine qkv"):
        qkv.load(own / "lm-lstm", engine="ctranslate2")


def test_generate_command_and_server(own, capsys):
    path = str(own / "lm-transformer")
    argv = ["generate", path, "--prefix", "the time", "--greedy", "--max-new-tokens", "30"]
    assert main(argv) == 0
    want = capsys.readouterr().out
    assert main([*argv, "--engine", "ctranslate2", "--threads", "1"]) == 0
    assert capsys.readouterr().out == want
    assert main([*argv, "--engine", "ctranslate2", "--int8"]) == 0
    assert capsys.readouterr().out.startswith("the time")

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qkv.serve import Limits
    from qkv.serve.app import create_app
    from qkv.serve.service import load_models

    limits = Limits()
    body = {"prefix": "the time", "max_new_tokens": 20, "temperature": 0, "stream": False}
    texts = []
    for engine in ("qkv", "ctranslate2"):
        models = load_models([path], limits, engine=engine, threads=1)
        assert models[0].frontend.engine == engine
        with TestClient(create_app(models, limits), base_url="http://127.0.0.1") as client:
            r = client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["text"])
    assert texts[1] == texts[0] and texts[0]


# --- an imported GPT-2 ---------------------------------------------------------------------------------------

def test_imported_gpt2_greedy_tokens_equal_qkv(tmp_path, capsys):
    """A tiny GPT-2 (transformers' GPT2LMHeadModel, a byte-level BPE), qkv import, the engine: greedy
    tokens equal qkv's float model's; int8 agreement printed."""
    pytest.importorskip("transformers")
    from test_import_gpt2 import SAMPLE, build_gpt2

    from qkv.importers import import_model

    ckpt = import_model(build_gpt2(tmp_path / "hf", train_steps=20), tmp_path / "q", log=lambda *a: None)
    ours, theirs = qkv.load(ckpt), qkv.load(ckpt, engine="ctranslate2", threads=1)
    int8 = qkv.load(ckpt, engine="ctranslate2", quantize="int8", threads=1)
    agree = total = 0
    for prompt in ["The Time Traveller", "His grey eyes", *SAMPLE[:3]]:
        want = qkv_greedy(ours, prompt, 24)
        assert list(theirs.token_ids(prompt, 24, 0.0)) == want
        text, full = "".join(theirs.generate(prompt, 24, 0.0)), "".join(ours.generate(prompt, 24, 0.0))
        assert "\ufffd" not in text and (text == full or "\ufffd" in full)  # (qkv's shows a split character's bytes)
        got = list(int8.token_ids(prompt, 24, 0.0))
        agree += sum(a == b for a, b in zip(want, got))
        total += len(want)
    with capsys.disabled():
        print(f"\nimported tiny GPT-2, CTranslate2 int8 greedy vs float: {agree}/{total} tokens equal position "
              "by position")

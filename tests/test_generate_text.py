"""Generated text comes out as the model's tokenizer writes it: whole characters, and prompts read whole.

A byte-level BPE (GPT-2's) or a byte-fallback one (Llama's) may split a character's UTF-8 bytes over
several tokens ("ü" = C3 BC in "Zürich"): decoding the first alone gives U+FFFD. ``generate`` holds
such bytes back until the character is complete, in the Python API, ``qkv generate`` and ``POST
/generate`` (streamed or not). An imported model reads a prompt with line breaks as its tokenizer does
("\\n" is a token), and stops at its end-of-text token. The references: the folder's tokenizer (its
``decode`` of the same ids) and transformers' ``generate``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("tokenizers") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason="transformers and tokenizers are not installed")
WORD = " Zürich café 東京"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    from test_import_gpt2 import build_gpt2

    from qkv.importers import import_model

    folder = build_gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2-tiny", train_steps=20)
    return import_model(folder, tmp_path_factory.mktemp("runs") / "gpt2", log=lambda *a: None)


@pytest.fixture
def scripted(monkeypatch):
    """The sampler made to draw given tokens (then stop): what the model writes, fixed."""
    tokens: list[int] = []

    def sample(model, prefix, max_new_tokens=200, *args, stop_at_eos=False, **kwargs):
        yield from tokens[:max_new_tokens]

    monkeypatch.setattr("qkv.decoding.sampling.sample", sample)
    return tokens


def split_character(lm, text: str) -> list[int]:
    """The ids of ``text`` in ``lm``'s tokenizer, checked to hold a character split over tokens."""
    t = lm.tokenizer
    ids = [i for i in t.encode_text(text)]
    assert any("\ufffd" in t.decode([ids[:n]])[0] for n in range(1, len(ids))), "no character is split"
    return ids


def test_api_streams_whole_characters(gpt2, scripted):
    import qkv

    lm = qkv.load(gpt2)
    scripted.extend(split_character(lm, WORD))
    pieces = list(lm.generate("A café in", max_new_tokens=50, temperature=0))
    assert "".join(pieces) == WORD
    assert not any("\ufffd" in p for p in pieces), pieces
    assert len(pieces) > 3  # streamed, piece by piece


def test_cli_prints_whole_characters(gpt2, scripted, capsys):
    import qkv
    from qkv.cli import main

    scripted.extend(split_character(qkv.load(gpt2), WORD))
    capsys.readouterr()
    assert main(["generate", str(gpt2), "--prefix", "A café in", "--temperature", "0", "--max-new-tokens", "50"]) == 0
    out = capsys.readouterr().out
    assert "Zürich café 東京" in out and "\ufffd" not in out


@pytest.mark.parametrize("stream", [False, True])
def test_serve_generate_whole_characters(gpt2, scripted, stream):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    import json

    import qkv
    from fastapi.testclient import TestClient
    from qkv.serve.app import create_app
    from qkv.serve.limits import Limits
    from qkv.serve.service import load_models

    scripted.extend(split_character(qkv.load(gpt2), WORD))
    limits = Limits()
    body = dict(prefix="A café in", max_new_tokens=50, temperature=0, stream=stream)
    with TestClient(create_app(load_models([str(gpt2)], limits), limits), base_url="http://127.0.0.1") as c:
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            assert r.json()["text"] == WORD
            return
        pieces = [json.loads(line[len("data: "):])["text"] for line in r.text.splitlines()
                  if line.startswith("data: ") and '"text"' in line]
    assert "".join(pieces) == WORD and not any("\ufffd" in p for p in pieces)


def test_bytes_that_never_make_a_character_come_out_at_the_end(gpt2, scripted):
    import qkv

    lm = qkv.load(gpt2)
    ids = split_character(lm, " ü")
    scripted.extend(ids[:-1])  # the first byte of ü only: generation ends on it
    text = "".join(lm.generate("x", max_new_tokens=50, temperature=0))
    assert text == lm.tokenizer.decode([lm.tokenizer.encode_text("x") + ids[:-1]])[0][1:] and text.endswith("\ufffd")


def test_greedy_text_equals_transformers_decode(gpt2):
    """Unscripted: the text greedy generation yields is transformers' decode of its generate(), prompts with
    line breaks included (read as the tokenizer reads them: "\\n" a token)."""
    import json as _json

    import qkv
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    source = Path(_json.loads((gpt2 / "config.json").read_text())["imported"]["from"])
    hf, tok = GPT2LMHeadModel.from_pretrained(str(source)).eval(), GPT2TokenizerFast.from_pretrained(str(source))
    lm = qkv.load(gpt2)
    for prompt in ["The Time Traveller", "His grey eyes\nshone", "Größere Häuser,\n\n"]:
        assert lm.tokenizer.to_model_ids(lm.prompt_ids(prompt)) == tok(prompt)["input_ids"]
        x = torch.tensor([tok(prompt)["input_ids"]])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                          pad_token_id=tok.eos_token_id)[0].tolist()
        if tok.eos_token_id in out[x.size(1):]:
            out = out[: x.size(1) + out[x.size(1):].index(tok.eos_token_id)]
        want = tok.decode(out)[len(tok.decode(out[: x.size(1)])):]
        assert "".join(lm.generate(prompt, max_new_tokens=16, temperature=0)) == want, prompt
    assert "\n" in tok.convert_tokens_to_string(tok.tokenize("a\nb"))  # "\n" is a token of its own

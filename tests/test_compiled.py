"""Compiled decoding (qkv.decoding.compiled): the static-shape step against the eager step, the
searches on it against the eager searches, and the flag's refusals."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from qkv.config import MODEL_PRESETS, DecodeConfig
from qkv.decoding.batch import decode_sentences
from qkv.decoding.compiled import CompiledDecoder
from qkv.errors import QkvError
from qkv.models.transformer import Transformer

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"


def tiny(**kw) -> Transformer:
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=40, tgt_vocab_size=40, dropout=0.0,
                              attention_dropout=0.0, **kw)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("kw,beam,in_place", [({}, 1, True), ({}, 3, True), ({}, 3, False),
                                              ({"norm_first": True}, 2, True), ({"positional": "learned"}, 1, True),
                                              ({"share_embeddings": False, "tie_output": False}, 2, True)])
def test_static_step_gives_the_eager_steps_logits(kw, beam, in_place):
    """Fixed buffers written at each position, the whole buffer attended under a mask that opens one
    position per step, the source padded to 16 positions: the eager step's logits (to float32
    rounding), through buffer growth (capacity 2 -> 4 -> 8), beam reorders and dropped sentences."""
    m = tiny(**kw)
    src = torch.randint(4, 40, (4, 7))
    src[1, 4:] = 0
    g = torch.Generator().manual_seed(1)
    static = CompiledDecoder(m, compile=False, capacity=2)
    static._in_place = in_place
    with torch.inference_mode():
        ref, got_state = m.start(src), static.start(src)
        assert got_state.memory_bias.size(-1) == 16 and got_state.self_kv[0].k.size(2) == 2
        if beam > 1:
            ref, got_state = ref.expand_beams(beam), got_state.expand_beams(beam)
        n, tokens = 4, torch.full((4 * beam,), 2)
        for t in range(7):
            want, ref = m.step(tokens, ref)
            got, got_state = static.step(tokens, got_state)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {t}")
            if t % 3 == 2:  # a sentence done: dropped; the others follow back-pointers
                n -= 1
                rows = (torch.arange(1, n + 1).unsqueeze(1) * beam + torch.randint(0, beam, (n, beam), generator=g))
                ref, got_state, tokens = ref.reorder(rows.view(-1)), got_state.reorder(rows.view(-1)), tokens[rows.view(-1)]
            tokens = torch.randint(4, 40, tokens.shape, generator=g)
        assert got_state.self_kv[0].k.size(2) == 8  # grown twice


def fixture_sources(tr, n: int) -> list[list[int]]:
    words = "a man woman dog runs on the street two children play in blue water green grass".split()
    rng = torch.Generator().manual_seed(3)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (int(k),), generator=rng))
             for k in torch.randint(1, 14, (n,), generator=rng)]
    return tr.tokenizers.src.encode(lines)


CFGS = [DecodeConfig(beam_size=1, batch_size=8), DecodeConfig(beam_size=5, nbest=2, batch_size=8),
        DecodeConfig(beam_size=4, batch_size=3, length_norm="length", length_penalty=1.0, early_stopping=True)]


@pytest.mark.parametrize("cfg", CFGS, ids=["greedy", "beam5-nbest2", "beam4-fairseq"])
def test_static_decoding_gives_the_eager_outputs(cfg):
    """Greedy and beam search on the static-shape step (not compiled, capacity 4 so that buffers
    grow): the eager search's hypotheses, token for token, with its scores."""
    import qkv

    tr = qkv.load(FIXTURES / "translate-transformer")
    src = fixture_sources(tr, 30)
    want = decode_sentences(tr.model, src, cfg)
    got = decode_sentences(CompiledDecoder(tr.model, compile=False, capacity=4), src, cfg)
    assert [[h.tokens for h in nb] for nb in got] == [[h.tokens for h in nb] for nb in want]
    for g_nb, w_nb in zip(got, want):
        for g, w in zip(g_nb, w_nb):
            assert g.score == pytest.approx(w.score, abs=1e-4)
    assert any(len(nb[0].tokens) > 4 for nb in want)  # some outputs outgrew the first buffers


def test_translator_with_the_static_step_keeps_target_prefix_and_nbest():
    import qkv

    tr = qkv.load(FIXTURES / "translate-transformer")
    lines = ["a man runs on the street", "two dogs"]
    want = (tr.translate_scored(lines, target_prefix="ein", beam_size=3, nbest=2), tr.translate(lines, beam_size=1))
    tr.decoder = CompiledDecoder(tr.model, compile=False)
    got = (tr.translate_scored(lines, target_prefix="ein", beam_size=3, nbest=2), tr.translate(lines, beam_size=1))
    assert [[t for t, _ in nb] for nb in got[0]] == [[t for t, _ in nb] for nb in want[0]]
    assert got[1] == want[1]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler")
def test_compiled_decoding_gives_the_eager_outputs():
    """The step compiled for the CPU (freezing, max-autotune with the C++ GEMM template): greedy and
    beam 5 give the eager outputs token for token."""
    import qkv

    tr = qkv.load(FIXTURES / "translate-transformer", compile=True)
    assert isinstance(tr.decoder, CompiledDecoder)
    src = fixture_sources(tr, 12)
    for cfg in (DecodeConfig(beam_size=1, batch_size=4), DecodeConfig(beam_size=5, batch_size=4)):
        want = decode_sentences(tr.model, src, cfg)
        got = decode_sentences(tr.decoder, src, cfg)
        assert [nb[0].tokens for nb in got] == [nb[0].tokens for nb in want], cfg


def test_compile_on_a_cpu_warns_once(monkeypatch):
    """Compiled decoding measured slower than eager on the CPUs tried: loading with compile=True on a
    CPU warns, the first time in the process only (a server loading several models warns once)."""
    import warnings

    import qkv
    from qkv.frontends import translator

    monkeypatch.setattr(translator, "_cpu_compile_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert isinstance(qkv.load(FIXTURES / "translate-transformer", compile=True).decoder, CompiledDecoder)
        qkv.load(FIXTURES / "translate-transformer")  # no --compile: nothing to say
    said = [str(w.message) for w in caught if "--compile" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("--compile on a CPU") and "slower" in said[0]
    monkeypatch.setattr(translator, "_cpu_compile_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qkv.load(FIXTURES / "translate-transformer")
    assert not [w for w in caught if "--compile" in str(w.message)]


def test_compile_refuses_what_it_cannot_compile():
    import qkv
    from qkv.serve.service import open_with

    with pytest.raises(QkvError, match=r"lm-transformer: compiled decoding .* is for translation Transformers"):
        qkv.load(FIXTURES / "lm-transformer", compile=True)
    with pytest.raises(QkvError, match=r"translate-lstm-general: compiled decoding .* \(lstm\)"):
        qkv.load(FIXTURES / "translate-lstm-general", compile=True)
    with pytest.raises(QkvError, match="int8"):
        qkv.load(FIXTURES / "translate-transformer", quantize="int8", compile=True)
    with pytest.raises(QkvError, match="engine='ctranslate2'"):
        qkv.load(FIXTURES / "translate-transformer", engine="ctranslate2", compile=True)
    with pytest.raises(QkvError, match="leave out --engine ctranslate2, or --compile"):
        open_with("ctranslate2", None, 0, None, compile=True)
    with pytest.raises(TypeError):
        CompiledDecoder(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("extra,message", [
    (["--engine", "ctranslate2"], "leave out --engine ctranslate2, or --compile"),
    (["--int8"], "not with int8 quantisation (--int8)"),
    (["--ensemble", str(FIXTURES / "translate-transformer")], "leave out --ensemble, or --compile"),
])
def test_translate_compile_flag_refusals(extra, message, capsys):
    from qkv.cli import main

    assert main(["translate", str(FIXTURES / "translate-transformer"), "a man", "--compile", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler")
def test_serve_answers_compiled_and_refuses_other_models():
    """``qkv serve --compile``: a translation from the server's batching thread, compiled, equals the
    eager translator's; a model of another kind stops it at start, named."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from qkv.serve import BackgroundServer, Limits
    from qkv.serve.app import create_app
    from qkv.serve.service import load_models

    texts = ["a man runs on the street", "two dogs play in the water"]
    eager = load_models([str(FIXTURES / "translate-transformer")], Limits())[0].frontend
    assert eager.decoder is None
    served = load_models([str(FIXTURES / "translate-transformer")], Limits(), compile=True)
    assert isinstance(served[0].frontend.decoder, CompiledDecoder)
    with BackgroundServer(create_app(served, Limits())) as server, httpx.Client(base_url=server.url, timeout=300) as c:
        answer = c.post("/translate", json={"texts": texts, "beam_size": 1})
    assert answer.status_code == 200, answer.text
    assert [r["hypotheses"][0]["text"] for r in answer.json()["results"]] == eager.translate(texts, beam_size=1)
    with pytest.raises(QkvError, match="classify-transformer: compiled decoding"):
        load_models([str(FIXTURES / "translate-transformer"), str(FIXTURES / "classify-transformer")], Limits(),
                    compile=True)

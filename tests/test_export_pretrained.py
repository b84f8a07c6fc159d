"""``qkv export --format ctranslate2`` of imported pretrained models, checked against transformers' own classes:

* encoder-only models (BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT, ELECTRA with embeddings as wide as its layers, and qkv's own
  SentencePiece encoders): tiny random folders built with transformers' classes (tests/encoder_families.py),
  ``qkv import``, export; ``ctranslate2.Encoder`` fed the pieces of the exported tokenizer.json gives the last
  hidden states of transformers' model within 1e-4, and the card's code, run as written on the exported folder,
  gives qkv embed's vectors; ALBERT (factorised embeddings, shared layers) and ELECTRA-small (narrow embeddings)
  are refused in one line naming the fields, nothing written;
* imported BART and T5 (v1 ReLU, tied; v1.1 gated-GELU, untied): ``ctranslate2.Translator.translate_batch``
  greedy through the exported tokenizer.json gives the tokens of qkv's greedy search and of transformers'
  ``generate(do_sample=False)``; the card's code runs as written; ``--engine ctranslate2`` translates BART as qkv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HAS = all(importlib.util.find_spec(m) is not None for m in ("ctranslate2", "transformers", "tokenizers"))
pytestmark = [pytest.mark.skipif(not HAS, reason='pip install -c constraints.txt -e ".[export,pretrained]"'),
              pytest.mark.usefixtures("one_torch_thread")]

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"


def export(capsys, ckpt: Path, out: Path) -> tuple[int, str]:
    from qkv.cli import main

    capsys.readouterr()
    rc = main(["export", str(ckpt), "--format", "ctranslate2", "--out", str(out)])
    return rc, capsys.readouterr().err


def imported(capsys, folder: Path, out: Path) -> Path:
    from qkv.cli import main

    assert main(["import", str(folder), "--out", str(out)]) == 0, capsys.readouterr().err
    return out


def card_python(out: Path) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", (out / "README.md").read_text(encoding="utf-8"), flags=re.M | re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


def run_card(out: Path, extra: str = "") -> str:
    """The card's Python as written (plus ``extra``), from the folder that holds the export."""
    r = subprocess.run([sys.executable, "-c", card_python(out) + extra], cwd=out.parent, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


# --- encoder-only models -------------------------------------------------------------------------------------

def roberta(path, family):
    from test_import_roberta import folder

    return folder(path, family)


def wide_electra(path):
    """An ELECTRA whose embeddings are as wide as its layers (the base and large discriminators': no projection)."""
    import test_import_encoders as enc
    from encoder_families import save_folder, template, transformers, wordpiece

    tok = wordpiece(enc.BERT_SPECIALS, template("[CLS]", "[SEP]"))
    cfg = transformers.ElectraConfig(vocab_size=tok.get_vocab_size(), embedding_size=enc.BERT_SHAPE["hidden_size"],
                                     pad_token_id=0, **enc.BERT_SHAPE)
    return save_folder(path, transformers.ElectraModel, cfg, tok, enc.BERT_NAMES)


def encoder_folder(name: str, path: Path):
    import test_import_encoders as enc

    return {"Roberta": lambda: roberta(path, "Roberta"), "XLMRoberta": lambda: roberta(path, "XLMRoberta"),
            "Camembert": lambda: roberta(path, "Camembert"),
            "DistilBert": lambda: enc.distilbert(path), "Electra": lambda: wide_electra(path),
            "Bert": lambda: enc.bert(path)}[name]()


@pytest.mark.parametrize("family", ["Bert", "Roberta", "XLMRoberta", "Camembert", "DistilBert", "Electra"])
def test_an_imported_encoder_exports_and_equals_transformers(tmp_path, capsys, family):
    import ctranslate2
    import tokenizers

    import qkv
    from encoder_families import TEXTS, batch

    path, ref, tok = encoder_folder(family, tmp_path / family.lower())
    ckpt = imported(capsys, path, tmp_path / "q")
    out = tmp_path / "ct2"
    rc, err = export(capsys, ckpt, out)
    assert rc == 0, err
    info = json.loads((out / "qkv_export.json").read_text())
    assert info["runtime"] == "ctranslate2.Encoder" and (out / "tokenizer.json").is_file()
    assert info["verified"]["checked"] and info["verified"]["max_abs_state_difference"] < 1e-4
    if family in ("Roberta", "XLMRoberta"):
        assert json.loads((ckpt / "config.json").read_text())["model"]["position_offset"] == 2  # padding_idx + 1
    # the pieces the card's rule makes of each text are the ids transformers' tokenizer gives
    exported = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    before, after = info["around_text"]["before"], info["around_text"]["after"]  # as the card's code writes them
    rows = [before + exported.encode(t, add_special_tokens=False).tokens + after for t in TEXTS]
    enc = batch(tok)
    real = enc["attention_mask"].bool()
    assert [[exported.token_to_id(p) for p in r] for r in rows] == [ids[m].tolist() for ids, m in
                                                                     zip(enc["input_ids"], real)]
    encoder = ctranslate2.Encoder(str(out), intra_threads=1)
    got = torch.from_numpy(np.array(encoder.forward_batch(rows).last_hidden_state))
    with torch.no_grad():
        want = ref(**enc).last_hidden_state
    delta = float((got - want)[real].abs().max())
    print(f"{family}: max |CTranslate2 - transformers| {delta:.2e}")
    assert delta < 1e-4
    # the card's code, as written: qkv embed's vectors for its two texts
    shown = run_card(out, "\nprint(__import__('json').dumps(vectors.tolist()))")
    vectors = torch.tensor(json.loads(shown.strip().splitlines()[-1]))
    texts = re.search(r"for text in (\[.*?\])\]", card_python(out)).group(1)
    assert (vectors - qkv.load(ckpt).embed(json.loads(texts))).abs().max() < 1e-4


@pytest.mark.parametrize("fixture", ["classify-transformer", "mlm-transformer"])
def test_an_own_encoder_exports_and_its_card_embeds_as_qkv(tmp_path, capsys, fixture):
    """A qkv-trained encoder (SentencePiece): the card's code gives qkv embed's vectors (its own pooling)."""
    import qkv

    out = tmp_path / "ct2"
    from qkv.cli import main

    capsys.readouterr()
    assert main(["export", str(FIXTURES / fixture), "--format", "ctranslate2", "--out", str(out)]) == 0
    said = capsys.readouterr().err  # the summary line (log)
    assert "for ctranslate2.Encoder" in said and "max |delta state|" in said, said
    assert (out / "source.spm").is_file() and "sentencepiece" in (out / "README.md").read_text()
    shown = run_card(out, "\nprint(__import__('json').dumps(vectors.tolist()))")
    vectors = torch.tensor(json.loads(shown.strip().splitlines()[-1]))
    texts = re.search(r"for text in (\[.*?\])\]", card_python(out)).group(1)
    assert (vectors - qkv.load(FIXTURES / fixture).embed(json.loads(texts))).abs().max() < 1e-4


@pytest.mark.parametrize("family, fields", [("albert", ("embedding_dim = 16", "layer_groups = 2", "ALBERT")),
                                            ("electra", ("embedding_dim = 16",))])
def test_what_the_encoder_spec_cannot_hold_is_refused_by_name(tmp_path, capsys, family, fields):
    import test_import_encoders as enc

    path, _, _ = getattr(enc, family)(tmp_path / family)
    ckpt = imported(capsys, path, tmp_path / "q")
    rc, err = export(capsys, ckpt, tmp_path / "ct2")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(f in err for f in fields), err
    assert not (tmp_path / "ct2").exists() and not list(tmp_path.glob(".ct2.tmp-*"))


# --- BART and T5 -----------------------------------------------------------------------------------------------

def ct2_greedy(out: Path, texts: list[str], limit: int) -> list[list[str]]:
    """The exported translator's greedy hypotheses (pieces), the sources tokenized as its card says."""
    import ctranslate2
    import tokenizers

    info = json.loads((out / "qkv_export.json").read_text())
    assert info["tokenizer_json"] == {"src": "tokenizer.json", "tgt": "tokenizer.json"}
    before, after = info["around_text"]["before"], info["around_text"]["after"]  # as the card's code writes them
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    translator = ctranslate2.Translator(str(out), intra_threads=1)
    sources = [before + tok.encode(t, add_special_tokens=False).tokens + after for t in texts]
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=limit)
    return [r.hypotheses[0] for r in results]


def test_imported_bart_exports_and_greedy_equals_qkv_and_generate(tmp_path, capsys):
    import tokenizers

    import qkv
    from qkv.decoding.batch import decode_sentences
    from qkv.decoding.greedy import banned_ids
    from test_import_bart import EN, SAMPLE, build_bart, hf_generate

    path, hf, _ = build_bart(tmp_path / "hf")
    ckpt = imported(capsys, path, tmp_path / "q")
    out = tmp_path / "ct2"
    rc, err = export(capsys, ckpt, out)
    assert rc == 0, err
    vocabulary = json.loads((out / "shared_vocabulary.json").read_text())
    assert len(set(vocabulary)) == len(vocabulary) and "<qkv-bos>" in vocabulary  # qkv's BOS row, not BART's <s>
    tr = qkv.load(ckpt)
    texts, limit = EN + SAMPLE, 25
    got = ct2_greedy(out, texts, limit)
    cfg = tr.decode_cfg.__class__(beam_size=1, max_len_a=0, max_len_b=limit)
    ours = [n[0].tokens for n in decode_sentences(tr.model, tr.tokenizers.src.encode(texts), cfg,
                                                  banned_ids(tr.tokenizers.tgt))]
    want = hf_generate(hf, tr, texts, 1, limit + 1)  # BART's decoder starts from </s>, writes <s> first
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    model_ids = tr.tokenizers.tgt.to_model_ids
    assert [[tok.token_to_id(p) for p in g] for g in got] == [model_ids(o) for o in ours] == \
        [model_ids(w) for w in want]
    assert got[0][0] == "<s>" and len(set(map(tuple, got))) > 4
    whole = ct2_greedy(out, texts, 100)  # every output ends with </s>: the texts of qkv translate
    assert [tok.decode([tok.token_to_id(p) for p in g], skip_special_tokens=True) for g in whole] == \
        tr.translate(texts, beam_size=1)
    printed = run_card(out)  # its beam search, its own settings: it runs as written
    assert printed.startswith("[") and len(printed.strip()) > 4
    # the engine runs the same conversion (its vocabulary strings are the export's)
    assert qkv.load(ckpt, engine="ctranslate2", threads=1).translate(texts, beam_size=1) == \
        tr.translate(texts, beam_size=1)


@pytest.mark.parametrize("version", ["v1", "v1.1"])
def test_imported_t5_exports_and_greedy_equals_qkv_and_generate(tmp_path, capsys, version):
    import tokenizers

    import qkv
    from qkv.config import EOS
    from qkv.decoding.greedy import banned_ids, greedy
    from test_import_t5 import SOURCES, build, reference

    folder = build(tmp_path / version, version)
    ckpt = imported(capsys, folder, tmp_path / "q")
    out = tmp_path / "ct2"
    rc, err = export(capsys, ckpt, out)
    assert rc == 0, err
    tr = qkv.load(ckpt)
    t = tr.tokenizers.src
    limit = 12
    got = ct2_greedy(out, SOURCES, limit)
    src_ids = [x + [EOS] for x in t.encode(SOURCES)]
    hf, _ = reference(folder)
    suppress = [i for i in t.to_model_ids(banned_ids(t)) if i is not None]
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for source, ids, hyp in zip(SOURCES, src_ids, got):
        with torch.inference_mode():
            ours = greedy(tr.model.eval(), torch.tensor([ids]), limit, banned=banned_ids(t))[0]
        x = torch.tensor([t.to_model_ids(ids)])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1, max_new_tokens=limit + 1,
                          suppress_tokens=suppress)[0, 1:].tolist()  # without the decoder start (T5's pad)
        ref = ref[: ref.index(1)] if 1 in ref else ref
        assert [tok.token_to_id(p) for p in hyp] == t.to_model_ids(ours) == ref[:limit], source
    assert len(set(map(tuple, got))) >= 3
    assert len(run_card(out).strip()) > 2

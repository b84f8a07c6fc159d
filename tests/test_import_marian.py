"""Importing a Hugging Face MarianMTModel (OPUS-MT) folder as a qkv translation checkpoint.

The folder is built the way a downloaded OPUS-MT model looks: a MarianConfig with
opus-mt-en-de's options (swish activation, scaled embeddings, static sinusoidal positions, shared
and tied embeddings, ``</s>`` 0, ``<unk>`` 1, ``<pad>`` last and the decoder's start, 4 beams) at
a width small enough for a test, random weights (with a random final_logits_bias, so that the bias
is carried), ``save_pretrained``; two tiny SentencePiece models and the vocab.json over their
pieces, written by ``MarianTokenizer.save_pretrained``. The references are transformers' own
``MarianMTModel`` and ``MarianTokenizer`` on that folder.
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

INSTALL = 'pip install -c constraints.txt -e ".[export]"'
HAS_HF = importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason=f"transformers is not installed: {INSTALL}")

EN = ["A man in a blue shirt is standing on a ladder.", "Two dogs play in the snow.",
      "A little girl climbs into a wooden playhouse.", "People are walking down the street at night.",
      "A woman with a red hat sells fruit at the market.", "The children are playing football in the park."]
DE = ["Ein Mann in einem blauen Hemd steht auf einer Leiter.", "Zwei Hunde spielen im Schnee.",
      "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.", "Menschen gehen nachts die Straße entlang.",
      "Eine Frau mit rotem Hut verkauft Obst auf dem Markt.", "Die Kinder spielen Fußball im Park."]
# accents, CJK, emoji, a long word, a language code, an empty text
SAMPLE = ["Größere Häuser: café, naïve, Ærø.", "東京で寿司を食べました。", "I 💖 emoji 🎉!",
          "Donaudampfschifffahrtsgesellschaftskapitänswitwe", ">>de<< A man is standing.", "",
          "   spaces   around   ", "Zwei Hunde spielen im Schnee."]


def train_spm(texts: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts * 3), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                   minloglevel=2)
    return buf.getvalue()


def opus_mt_en_de_config(vocab_size: int, **small):
    """opus-mt-en-de's configuration (its options; the sizes of ``small`` for a fast test)."""
    from transformers import MarianConfig

    options = dict(
        activation_function="swish", activation_dropout=0.0, attention_dropout=0.0, dropout=0.1,
        d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
        encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, init_std=0.02,
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, pad_token_id=vocab_size - 1, eos_token_id=0,
        bos_token_id=0, decoder_start_token_id=vocab_size - 1, forced_eos_token_id=0, num_beams=4, max_length=512,
        bad_words_ids=[[vocab_size - 1]], architectures=["MarianMTModel"],
    )
    options.update(small)
    return MarianConfig(**options)


def build_marian(out: Path, seed: int = 0, train_steps: int = 100, **small) -> Path:
    """A MarianMTModel folder as OPUS-MT ships one, with random weights."""
    from transformers import MarianMTModel, MarianTokenizer

    out.mkdir(parents=True, exist_ok=True)
    t = out / "spm-inputs"
    t.mkdir()
    (t / "source.spm").write_bytes(train_spm(EN + SAMPLE[:3], 120))
    (t / "target.spm").write_bytes(train_spm(DE + SAMPLE[:2], 120))
    import sentencepiece as spm

    pieces = ["</s>", "<unk>"]
    for name in ("source.spm", "target.spm"):
        sp = spm.SentencePieceProcessor(model_file=str(t / name))
        for i in range(sp.get_piece_size()):
            p = sp.id_to_piece(i)
            if not (sp.is_control(i) or sp.is_unknown(i)) and p not in pieces:
                pieces.append(p)
    pieces.append("<pad>")
    (t / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False))
    tok = MarianTokenizer(str(t / "source.spm"), str(t / "target.spm"), str(t / "vocab.json"))
    tok.save_pretrained(str(out))
    for f in t.iterdir():
        f.unlink()
    t.rmdir()
    torch.manual_seed(seed)
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    sizes.update(small)
    model = MarianMTModel(opus_mt_en_de_config(len(pieces), **sizes))
    # A random Marian ignores its source and never ends: train it a little (in transformers) on the
    # six pairs so that outputs depend on the source and end at several lengths, as a real model's do.
    tok = MarianTokenizer.from_pretrained(str(out))
    batch = tok(EN, text_target=DE, padding=True, return_tensors="pt")
    batch["labels"][batch["labels"] == tok.pad_token_id] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(train_steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5)  # carried by the import (a zero bias would not show it)
        model.final_logits_bias[0, 0] = 2.0  # </s>
    pad = len(pieces) - 1  # opus-mt-en-de's generation_config.json
    model.generation_config.update(num_beams=4, max_length=512, bad_words_ids=[[pad]], renormalize_logits=True)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    return build_marian(tmp_path_factory.mktemp("opus-mt") / "opus-mt-en-de-tiny")


@pytest.fixture(scope="module")
def imported(marian_dir, tmp_path_factory):
    from qkv.importers.marian import write

    return write(marian_dir, tmp_path_factory.mktemp("runs") / "marian")


def hf_pair(marian_dir):
    from transformers import MarianMTModel, MarianTokenizer

    return MarianMTModel.from_pretrained(str(marian_dir)).eval(), MarianTokenizer.from_pretrained(str(marian_dir))


def test_token_ids_equal_marian_tokenizer(marian_dir, imported):
    """qkv's ids are MarianTokenizer's, remapped (qkv id i = Marian id rows[i]), EOS appended by collate."""
    import qkv
    from qkv.config import EOS

    _, tok = hf_pair(marian_dir)
    tr = qkv.load(imported)
    rows = tr.tokenizers.rows
    want = tok(SAMPLE)["input_ids"]
    got = [[rows[i] for i in ids + [EOS]] for ids in tr.tokenizers.src.encode(SAMPLE)]
    assert got == want
    assert any(tok.unk_token_id in ids for ids in want)  # the sample reaches <unk> (CJK, emoji)
    want_tgt = tok(text_target=DE)["input_ids"]  # the target side: target.spm
    got_tgt = [[rows[i] for i in ids + [EOS]] for ids in tr.tokenizers.tgt.encode(DE)]
    assert got_tgt == want_tgt
    assert tr.tokenizers.src.encode(DE) != tr.tokenizers.tgt.encode(DE)  # two segmenters: the test tells them apart


def padded_batch(tr, texts):
    from qkv.data.batching import collate

    return collate(tr.tokenizers.src.encode(texts), tr.tokenizers.tgt.encode(DE[: len(texts)]))


def test_hidden_states_and_logits_equal_transformers(marian_dir, imported):
    """Encoder states and decoder logits within 1e-4 of MarianMTModel's on a padded batch."""
    import qkv
    from qkv.config import PAD

    hf, _ = hf_pair(marian_dir)
    tr = qkv.load(imported)
    model = tr.model
    rows = torch.tensor(tr.tokenizers.rows)
    texts = EN[:4]
    batch = padded_batch(tr, texts)
    assert (batch.src == PAD).any() and (batch.tgt_in == PAD).any()  # padded on both sides
    src_hf, tgt_hf = rows[batch.src], rows[batch.tgt_in]  # BOS -> <pad>, the decoder's start
    with torch.inference_mode():
        out = hf(input_ids=src_hf, attention_mask=batch.src != PAD, decoder_input_ids=tgt_hf,
                 decoder_attention_mask=batch.tgt_in != PAD, output_hidden_states=True)
        memory, _, _ = model.encode(batch.src)
        logits = model(batch.src, batch.tgt_in)
    real_src = batch.src != PAD
    assert float((memory - out.encoder_last_hidden_state)[real_src].abs().max()) <= 1e-4
    real_tgt = torch.zeros_like(batch.tgt_in, dtype=torch.bool)
    real_tgt[:, 0] = True
    real_tgt |= batch.tgt_in != PAD
    want = out.logits[..., rows]  # Marian's columns in qkv's order
    assert float((logits - want)[real_tgt].abs().max()) <= 1e-4
    assert out.logits.abs().max() > 1.0  # logits that discriminate, not all near 0


def hf_generate(hf, tr, texts, num_beams, length_penalty, max_new_tokens):
    """transformers' generate on qkv's inputs under qkv's settings: PAD, UNK and the BOS row banned
    (qkv never emits a special piece; <pad> is qkv's BOS too), EOS forced at the limit."""
    from qkv.config import EOS, PAD, UNK
    from qkv.data.batching import collate

    rows = tr.tokenizers.rows
    src = torch.tensor(rows)[collate(tr.tokenizers.src.encode(texts), None).src]
    out = hf.generate(input_ids=src, attention_mask=src != rows[PAD], num_beams=num_beams,
                      length_penalty=length_penalty, early_stopping=False, max_new_tokens=max_new_tokens,
                      do_sample=False, no_repeat_ngram_size=0, repetition_penalty=1.0, renormalize_logits=False,
                      bad_words_ids=[[rows[PAD]], [rows[UNK]]], forced_eos_token_id=rows[EOS])
    back = {m: q for q, m in enumerate(rows) if q != 2}
    result = []
    for row in out.tolist():
        ids = [back[m] for m in row[1:]]
        result.append(ids[: ids.index(EOS)] if EOS in ids else [i for i in ids if i != PAD])
    return result


@pytest.mark.parametrize("beam, limit", [(1, 30), (4, 100)])
def test_greedy_and_beam_equal_generate(marian_dir, imported, beam, limit):
    """qkv's greedy and beam outputs are generate()'s. A hypothesis at the length limit ends with
    the model's own log p(EOS) in qkv and with a forced EOS (log-prob 0) in generate(): the beam
    test's limit is one no hypothesis reaches (the greedy one's is reached, and equal)."""
    import qkv
    from qkv.decoding.batch import decode_sentences
    from qkv.decoding.greedy import banned_ids

    hf, _ = hf_pair(marian_dir)
    tr = qkv.load(imported)
    texts = EN + SAMPLE[:4]
    want = hf_generate(hf, tr, texts, beam, 1.0, limit + 1)
    cfg = tr.decode_cfg.__class__(beam_size=beam, length_penalty=1.0, length_norm="length", max_len_a=0,
                                  max_len_b=limit, early_stopping=False)
    best = decode_sentences(tr.model, tr.tokenizers.src.encode(texts), cfg, banned_ids(tr.tokenizers.tgt))
    got = [n[0].tokens for n in best]
    assert got == want
    assert len({len(g) for g in got}) > 1  # outputs of several lengths, some ending before the limit
    assert len(set(map(tuple, got))) > 5  # that depend on the source
    if beam > 1:
        assert max(len(g) for g in got) < limit


def test_imported_settings(imported, marian_dir):
    """The checkpoint says what it is: Marian's options as named fields, the folder's search settings."""
    from qkv.checkpoint import read_config

    cfg, dec = read_config(imported, "model"), read_config(imported, "decode")
    assert (cfg.activation, cfg.sinusoid_layout, cfg.output_bias, cfg.norm_first, cfg.has_final_norm) == \
        ("silu", "halves", True, False, False)
    hf = json.loads((marian_dir / "config.json").read_text())
    assert cfg.src_vocab_size == hf["vocab_size"] + 1  # BOS: a second copy of <pad>'s row
    assert (dec.beam_size, dec.length_norm, dec.max_len_a, dec.max_len_b) == (4, "length", 0.0, 510)


@pytest.mark.parametrize("change, message", [
    ({"share_encoder_decoder_embeddings": False}, "share_encoder_decoder_embeddings"),
    ({"activation_function": "tanh"}, "activation_function 'tanh'"),
    ({"scale_embedding": False}, "scale_embedding"),
    ({"model_type": "fsmt", "architectures": ["FSMTForConditionalGeneration"]}, "FSMTForConditionalGeneration is not supported"),
    ({"decoder_ffn_dim": 128}, "decoder_ffn_dim"),
])
def test_unsupported_options_are_refused_by_name(marian_dir, tmp_path, change, message):
    import shutil

    from qkv.errors import QkvError
    from qkv.importers.marian import write

    d = tmp_path / "m"
    shutil.copytree(marian_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QkvError, match=message):
        write(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_files_are_named(marian_dir, tmp_path):
    import shutil

    from qkv.errors import QkvError
    from qkv.importers.marian import write

    for name in ("vocab.json", "target.spm", "model.safetensors", "config.json"):
        d = tmp_path / name
        shutil.copytree(marian_dir, d)
        (d / name).unlink()
        with pytest.raises(QkvError, match=f"{name}|no weights"):
            write(d, tmp_path / f"out-{name}")


# --- the commands on an imported model: import, translate, score, viz attention, fine-tune, export --------

HAS_CT2 = importlib.util.find_spec("ctranslate2") is not None


def test_import_command_and_commands_on_the_import(marian_dir, tmp_path, capsys):
    """``qkv import`` writes the checkpoint; translate, score and viz attention take it as any other."""
    import qkv
    from qkv.cli import main

    ckpt = tmp_path / "ende"
    assert main(["import", str(marian_dir), "--out", str(ckpt)]) == 0
    want = qkv.load(ckpt).translate(EN[:2], beam_size=1)
    capsys.readouterr()
    assert main(["translate", str(ckpt), "--beam-size", "1", *EN[:2]]) == 0
    assert capsys.readouterr().out.splitlines() == want
    assert want[1] == DE[1]  # the model learned its six pairs (in transformers): the import translates them
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("\n".join(EN[:3]) + "\n")
    tgt.write_text("\n".join(DE[:3]) + "\n")
    assert main(["score", str(ckpt), "--src", str(src), "--tgt", str(tgt), "--output", str(tmp_path / "s.txt")]) == 0
    assert len((tmp_path / "s.txt").read_text().splitlines()) == 3
    assert main(["viz", "attention", str(ckpt), EN[1], "--target", DE[1], "--out", str(tmp_path / "att")]) == 0
    assert (tmp_path / "att.html").is_file()
    assert main(["import", str(marian_dir), "--out", str(ckpt)]) == 2  # never over an existing checkpoint


def multi30k(n: int, split: str = "train") -> tuple[list[str], list[str]]:
    import gzip

    root = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"
    if not root.is_dir():
        root = Path("/work/shared/data/multi30k")
    if not (root / f"{split}.en.gz").is_file():
        pytest.skip(f"Multi30k is not at {root} (see the data README)")
    with gzip.open(root / f"{split}.en.gz", "rt", encoding="utf-8") as f_en, \
            gzip.open(root / f"{split}.de.gz", "rt", encoding="utf-8") as f_de:
        pairs = [(e.strip(), d.strip()) for e, d, _ in zip(f_en, f_de, range(n))]
    return [e for e, _ in pairs], [d for _, d in pairs]


@pytest.fixture(scope="module")
def finetuned(imported, tmp_path_factory):
    """``qkv train --init-from`` the import, a handful of updates on Multi30k pairs (or the six pairs)."""
    from qkv.cli import main

    d = tmp_path_factory.mktemp("ft")
    try:
        en, de = multi30k(200)
    except pytest.skip.Exception:
        en, de = EN * 10, DE * 10
    (d / "train.en").write_text("\n".join(en) + "\n")
    (d / "train.de").write_text("\n".join(de) + "\n")
    (d / "valid.en").write_text("\n".join(EN) + "\n")
    (d / "valid.de").write_text("\n".join(DE) + "\n")
    out = d / "run"
    rc = main(["train", "--init-from", str(imported), "--src-train", str(d / "train.en"), "--tgt-train",
               str(d / "train.de"), "--src-valid", str(d / "valid.en"), "--tgt-valid", str(d / "valid.de"),
               "--max-steps", "6", "--eval-every", "6", "--max-tokens", "600", "--schedule", "constant",
               "--lr", "0.0003", "--out", str(out), "--threads", "1"])
    assert rc == 0
    return out / "last"


def test_finetune_from_the_import(imported, finetuned):
    """The fine-tuned model keeps the import's architecture and tokenizer, and its weights moved."""
    from qkv.checkpoint import read_checkpoint, read_config
    from qkv.data.marian_tokenizer import MarianTokenizerPair
    from qkv.tasks.base import checkpoint_tokenizers

    a, b = read_checkpoint(imported), read_checkpoint(finetuned)
    assert read_config(b, "model").sinusoid_layout == "halves" and read_config(b, "model").activation == "silu"
    assert isinstance(checkpoint_tokenizers(finetuned), MarianTokenizerPair)
    assert set(a.state_dict) == set(b.state_dict)
    moved = [n for n in a.state_dict if not torch.equal(a.state_dict[n], b.state_dict[n])]
    assert "output_bias" in moved and len(moved) > len(a.state_dict) // 2


@pytest.mark.parametrize("fmt", ["hf", "ctranslate2"])
def test_round_trip_export_greedy_equals_qkv(finetuned, tmp_path, fmt):
    """The fine-tuned import exports back to a MarianMTModel folder (OPUS-MT's own vocabulary order)
    and to CTranslate2, each with greedy outputs equal to qkv's."""
    import qkv
    from qkv.cli import main

    if fmt == "ctranslate2" and not HAS_CT2:
        pytest.skip(f"ctranslate2 is not installed: {INSTALL}")
    out = tmp_path / fmt
    assert main(["export", str(finetuned), "--format", fmt, "--out", str(out)]) == 0
    tr = qkv.load(finetuned)
    texts = EN + SAMPLE[:4]
    limit = 20
    want = tr.translate(texts, beam_size=1, max_len_a=0, max_len_b=limit)
    if fmt == "hf":
        from transformers import MarianMTModel, MarianTokenizer

        hf, tok = MarianMTModel.from_pretrained(str(out)).eval(), MarianTokenizer.from_pretrained(str(out))
        assert json.loads((out / "vocab.json").read_text()) == tr.tokenizers.vocab  # the original order back
        batch = tok(texts, return_tensors="pt", padding=True)
        ids = hf.generate(**batch, num_beams=1, max_new_tokens=limit + 1, renormalize_logits=False)
        got = tok.batch_decode(ids, skip_special_tokens=True)
    else:
        import ctranslate2

        model = ctranslate2.Translator(str(out), device="cpu")
        pieces = [[tr.tokenizers.src.id_to_piece(i) for i in ids] for ids in tr.tokenizers.src.encode(texts)]
        res = model.translate_batch(pieces, beam_size=1, max_decoding_length=limit, min_decoding_length=0)
        got = [tr.tokenizers.tgt.decode([tr.tokenizers.tgt.piece_ids(r.hypotheses[0], "ct2")])[0] for r in res]
    assert got == want


def test_serve_translates_and_scores_with_the_import(imported):
    """``qkv serve``'s /translate and /score on the imported model answer as the front-end does."""
    import qkv
    from import_folders import served

    want = qkv.load(imported).translate(EN[:3], beam_size=2)
    with served(imported) as c:
        r = c.post("/translate", json={"texts": EN[:3], "beam_size": 2})
        assert r.status_code == 200, r.text
        assert [x["hypotheses"][0]["text"] for x in r.json()["results"]] == want
        r = c.post("/score", json={"sources": EN[:2], "targets": DE[:2]})
        assert r.status_code == 200, r.text


def test_load_of_the_folder_converts_in_memory(marian_dir, imported):
    """``qkv.load(folder)`` is the import without the checkpoint: the same translations, the folder's
    search settings (4 beams)."""
    import qkv

    direct, saved = qkv.load(marian_dir), qkv.load(imported)
    assert direct.decode_cfg == saved.decode_cfg and direct.decode_cfg.beam_size == 4
    assert direct.translate(EN[:3]) == saved.translate(EN[:3])

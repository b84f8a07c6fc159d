"""The tokenizer.json backend of imported models (qkv.data.pretrained): its ids, mapped back to the
model's, equal the original tokenizer's (transformers' AutoTokenizer) on a multilingual sample, for
WordPiece (BERT) and byte-level BPE (GPT-2); the special tokens land on qkv's fixed ids; the
embedding rows follow the same map; a checkpoint keeps the tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.config import BOS, CLS, EOS, MASK, PAD, SEP, UNK
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError

tokenizers = pytest.importorskip("tokenizers", reason="pip install -c constraints.txt -e '.[pretrained]'")
transformers = pytest.importorskip("transformers", reason="pip install -c constraints.txt -e '.[export]'")

from qkv.data.pretrained import HFTokenizer, IdMap, roles, single_template, special_token_names  # noqa: E402

SAMPLE = [
    "The café's crème brûlée was naïve; Ærøskøbing, São Paulo, Dvořák, İstanbul.",
    "東京は日本の首都です。北京欢迎你！서울특별시",
    "emoji 🤖🎉👍🏽 and flags 🇩🇪 — “quotes” ‘too’ … ½",
    "Donaudampfschifffahrtsgesellschaftskapitänsmützenabzeichen pneumonoultramicroscopicsilicovolcanoconiosis",
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم. שלום עולם",
    "numbers 3.14159 and 1,000,000 and e-mail a.b@c.de   spaced\ttabs",
    "a [MASK] in the middle",
]
TRAIN = SAMPLE[:5] + ["the quick brown fox jumps over the lazy dog " * 3, "café naïve 東京 北京 emoji 🤖"] * 3


def wordpiece_folder(tmp_path):
    """A BERT tokenizer (lower-cased WordPiece) trained here, saved as transformers saves BertTokenizerFast."""
    from tokenizers.implementations import BertWordPieceTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(TRAIN, vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    fast = transformers.BertTokenizerFast(tokenizer_object=wp._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                                          pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    fast.save_pretrained(tmp_path)
    return tmp_path


def bytelevel_folder(tmp_path):
    """A GPT-2 style byte-level BPE trained here, with <|endoftext|> as its one special token."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TRAIN, vocab_size=400, special_tokens=["<|endoftext|>"])
    fast = transformers.GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="<|endoftext|>",
                                          bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path)
    return tmp_path


def bert_tokenizer(folder) -> HFTokenizer:
    raw = (folder / "tokenizer.json").read_bytes()
    names = special_token_names(folder)
    before, after = single_template(raw, str(folder))
    r = roles(raw, names, str(folder))
    assert before == [r[CLS]]  # what qkv's encoder tasks put first themselves
    return HFTokenizer.create(raw, r, after)


def as_original(tok: HFTokenizer, ids: list[int], first: list[int]) -> list[int]:
    return tok.to_model_ids(first + ids)


def check_against_autotokenizer(folder, tok: HFTokenizer, first: list[int]):
    original = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text, ids in zip(SAMPLE, tok.encode(SAMPLE)):
        want = original(text)["input_ids"]
        assert as_original(tok, ids, first) == want, text
        assert len(set(want)) > 3  # the sample is tokenized, not all [UNK]


def test_wordpiece_ids_equal_autotokenizers(tmp_path):
    folder = wordpiece_folder(tmp_path)
    tok = bert_tokenizer(folder)
    check_against_autotokenizer(folder, tok, [CLS])
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    for slot, name in {PAD: "[PAD]", UNK: "[UNK]", CLS: "[CLS]", SEP: "[SEP]", MASK: "[MASK]"}.items():
        assert tok.to_model_ids([slot]) == [vocab[name]]
    assert tok.to_model_ids([BOS, EOS]) == [None, None]  # BERT has none: rows of their own
    assert tok.vocab_size == len(vocab) + 2
    ids = tok.encode(["a [MASK] in the middle"])[0]
    assert MASK in ids and ids[-1] == SEP
    assert tok.decode([ids]) == ["a in the middle"]  # special tokens dropped


def test_bytelevel_bpe_ids_equal_autotokenizers(tmp_path):
    folder = bytelevel_folder(tmp_path)
    raw = (folder / "tokenizer.json").read_bytes()
    end = json.loads(raw)["added_tokens"][0]["id"]
    tok = HFTokenizer.create(raw, {EOS: end})  # one token, one role: GPT-2's importer chooses EOS
    check_against_autotokenizer(folder, tok, [])
    assert tok.decode(tok.encode(SAMPLE[:5])) == SAMPLE[:5]  # byte-level: every text comes back


def test_the_real_minilm_wordpiece_equals_autotokenizers(minilm_dir):
    tok = bert_tokenizer(minilm_dir)
    check_against_autotokenizer(minilm_dir, tok, [CLS])
    assert tok.to_model_ids([PAD, UNK, CLS, SEP, MASK]) == [0, 100, 101, 102, 103]


def test_the_rows_follow_the_ids():
    ids = IdMap.build(10, {PAD: 0, UNK: 5, CLS: 6, SEP: 7, MASK: 8})
    assert ids.model_ids == (0, 5, None, None, 6, 8, 7, 1, 2, 3, 4, 9)
    w = torch.arange(10.0)[:, None].repeat(1, 3)
    rows = ids.rows(w)
    for q, m in enumerate(ids.model_ids):
        assert rows[q].tolist() == ([0.0] * 3 if m is None else w[m].tolist())
    with pytest.raises(QkvError, match="cannot fill two of qkv's special roles"):
        IdMap.build(10, {UNK: 3, EOS: 3})


def test_a_checkpoint_keeps_the_tokenizer(tmp_path):
    folder = wordpiece_folder(tmp_path / "hf")
    tok = bert_tokenizer(folder)
    pair = TokenizerPair(tok, tok)
    assert pair.files() == ["tokenizer.json", "tokenizer_ids.json"]
    pair.save(tmp_path / "ckpt")
    back = TokenizerPair.load(tmp_path / "ckpt", pair.files())
    assert isinstance(back.src, HFTokenizer) and back.joint
    assert back.src.encode(SAMPLE) == tok.encode(SAMPLE) and back.src.model_bytes == tok.model_bytes
    (tmp_path / "ckpt" / "tokenizer_ids.json").write_text('{"model_ids": [0, 0, 1, 2, 3, 4, 5]}')
    with pytest.raises(QkvError, match="tokenizer_ids.json: 'model_ids' names a model id twice"):
        TokenizerPair.load(tmp_path / "ckpt", pair.files())

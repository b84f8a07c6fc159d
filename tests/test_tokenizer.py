"""Tests for qkv.data.tokenizer: special ids, round trips, char vocabularies, saving and loading."""

from __future__ import annotations

import re
import unicodedata

import pytest

from qkv.config import BOS, EOS, PAD, UNK
from qkv.data.tokenizer import Tokenizer, TokenizerPair
from qkv.errors import QkvError

ANIMALS = ["cat", "dog", "bird", "fish", "horse"]
COLOURS = ["red", "green", "blue", "black", "white"]
ENGLISH = [f"the {COLOURS[i % 5]} {ANIMALS[i // 5 % 5]} sees {i} stones" for i in range(50)]
GERMAN = [f"der {['rote', 'grüne', 'blaue'][i % 3]} Hund sieht {i} Steine" for i in range(50)]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train(ENGLISH, vocab_size=60, model_type="bpe")


def test_special_ids_and_pieces(bpe: Tokenizer) -> None:
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    assert [bpe.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]


def test_vocab_size_is_an_upper_bound(bpe: Tokenizer) -> None:
    assert 4 < bpe.vocab_size <= 60
    # a corpus this small cannot fill 5000 pieces: it gets fewer instead of an error
    small = Tokenizer.train(ENGLISH, vocab_size=5000, model_type="bpe")
    assert bpe.vocab_size < small.vocab_size < 5000


@pytest.mark.parametrize("model_type", ["bpe", "unigram", "char"])
def test_round_trip_without_bos_eos(model_type: str) -> None:
    tok = Tokenizer.train(ENGLISH, vocab_size=60, model_type=model_type)
    ids = tok.encode(ENGLISH)
    assert len(ids) == len(ENGLISH)
    assert all(BOS not in row and EOS not in row and PAD not in row and UNK not in row for row in ids)
    assert tok.decode(ids) == ENGLISH


def test_decode_drops_specials_and_cuts_at_eos(bpe: Tokenizer) -> None:
    (cat,) = bpe.encode(["the red cat"])
    (dog,) = bpe.encode(["dog"])
    assert bpe.decode([[BOS, *cat, EOS, *dog, PAD], [*cat, PAD, PAD], [EOS, *dog]]) == ["the red cat", "the red cat", ""]


def test_unknown_character_maps_to_unk(bpe: Tokenizer) -> None:
    (ids,) = bpe.encode(["the € cat"])
    assert UNK in ids


def test_char_vocabulary_is_what_the_characters_need() -> None:
    texts = ["grüße aus köln", "½ liter", "abc"]
    tok = Tokenizer.train(texts, vocab_size=5, model_type="char")
    # independent count: NFKC-normalized characters, space shown as '▁', plus 4 specials
    chars = set("".join(unicodedata.normalize("NFKC", t) for t in texts).replace(" ", "▁")) | {"▁"}
    assert tok.vocab_size == 4 + len(chars)
    assert {tok.id_to_piece(i) for i in range(4, tok.vocab_size)} == chars
    assert tok.decode(tok.encode(["köln abc"])) == ["köln abc"]


def test_training_is_silent(capfd: pytest.CaptureFixture[str]) -> None:
    Tokenizer.train(ENGLISH, vocab_size=40, model_type="unigram")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_training_errors() -> None:
    with pytest.raises(QkvError, match="model type"):
        Tokenizer.train(ENGLISH, vocab_size=60, model_type="wordpiece")
    with pytest.raises(QkvError, match="empty corpus"):
        Tokenizer.train(["", "  "], vocab_size=60)
    with pytest.raises(QkvError, match="vocab_size=8"):  # fewer pieces than the corpus' characters
        Tokenizer.train(ENGLISH, vocab_size=8, model_type="bpe")


def test_save_and_load_keep_the_model_bytes(bpe: Tokenizer, tmp_path) -> None:
    path = tmp_path / "m.model"
    bpe.save(path)
    assert path.read_bytes() == bpe.model_bytes
    loaded = Tokenizer.from_file(path)
    assert loaded.vocab_size == bpe.vocab_size
    assert loaded.encode(ENGLISH) == bpe.encode(ENGLISH)


def test_from_file_errors(tmp_path) -> None:
    with pytest.raises(QkvError, match="missing.model"):
        Tokenizer.from_file(tmp_path / "missing.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a protobuf \xff\xff")
    with pytest.raises(QkvError, match="garbage.model"):
        Tokenizer.from_file(garbage)


def test_joint_pair(tmp_path) -> None:
    pair = TokenizerPair.train(ENGLISH, GERMAN, vocab_size=80, model_type="bpe", joint=True)
    assert pair.joint and pair.src is pair.tgt
    assert pair.files() == ["spm.model"]
    # one vocabulary covers both languages
    assert pair.tgt.decode(pair.tgt.encode(GERMAN)) == GERMAN
    assert pair.src.decode(pair.src.encode(ENGLISH)) == ENGLISH
    pair.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["spm.model"]
    loaded = TokenizerPair.load(tmp_path / "ckpt")
    assert loaded.joint
    assert loaded.src.encode(GERMAN) == pair.src.encode(GERMAN)


def test_separate_pair(tmp_path) -> None:
    pair = TokenizerPair.train(ENGLISH, GERMAN, vocab_size=60, model_type="bpe", joint=False)
    assert not pair.joint
    assert pair.files() == ["spm.src.model", "spm.tgt.model"]
    # the English model never saw 'ü'
    assert UNK in pair.src.encode(["grüne"])[0] and UNK not in pair.tgt.encode(["grüne"])[0]
    pair.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.src.model", "spm.tgt.model"]
    loaded = TokenizerPair.load(tmp_path)
    assert not loaded.joint
    assert loaded.src.encode(ENGLISH) == pair.src.encode(ENGLISH)
    assert loaded.tgt.encode(GERMAN) == pair.tgt.encode(GERMAN)


def test_pair_load_errors(tmp_path) -> None:
    with pytest.raises(QkvError, match=re.escape(str(tmp_path))):
        TokenizerPair.load(tmp_path)
    pair = TokenizerPair.train(ENGLISH, GERMAN, vocab_size=60, model_type="char", joint=False)
    pair.save(tmp_path)
    (tmp_path / "spm.tgt.model").unlink()
    with pytest.raises(QkvError, match="spm.tgt.model"):
        TokenizerPair.load(tmp_path)

"""Marian's tokenizer (OPUS-MT): two SentencePiece models and one vocabulary, with qkv's special ids.

A Marian model folder holds ``source.spm`` and ``target.spm`` (SentencePiece models of each
language) and ``vocab.json`` (piece -> id, one vocabulary for both sides and for the model's
embeddings). Hugging Face's ``MarianTokenizer`` segments a text with the source model, looks each
piece up in ``vocab.json`` (a piece it lacks is ``<unk>``) and appends ``</s>``; a leading
language code such as ``>>de<<`` is one token. This module does the same.

Special ids. qkv's ids are fixed (PAD 0, UNK 1, BOS 2, EOS 3, :mod:`qkv.config`); Marian's are
whatever ``vocab.json`` says (opus-mt-en-de: ``</s>`` 0, ``<unk>`` 1, ``<pad>`` 58100, and the
decoder starts from ``<pad>``). qkv **remaps rows**: qkv id ``i`` is Marian id ``rows[i]`` with

    rows = [pad, unk, pad, eos] + every other Marian id in ascending order

so the importer reorders the embedding rows and the output bias once, and the rest of qkv
(batching, masks, decoding) keeps its fixed ids. BOS is a second copy of ``<pad>``'s row, because
a Marian decoder starts from ``<pad>``: the qkv vocabulary has one row more than Marian's.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path

import sentencepiece as spm

from qkv.config import BOS, EOS, PAD, UNK
from qkv.data.tokenizer import TokenizerPair, until_eos
from qkv.errors import QkvError

SOURCE_SPM, TARGET_SPM, VOCAB, SPECIALS = "source.spm", "target.spm", "vocab.json", "marian_specials.json"
FILES = (SOURCE_SPM, TARGET_SPM, VOCAB, SPECIALS)


def marian_rows(vocab: dict[str, int], pad: str, unk: str, eos: str) -> list[int]:
    """The Marian id of each qkv id: ``[pad, unk, pad (as BOS), eos]`` + the others ascending."""
    special = [vocab[pad], vocab[unk], vocab[pad], vocab[eos]]
    taken = set(special)
    return special + sorted(i for i in set(vocab.values()) if i not in taken)


def read_vocab(path: Path) -> dict[str, int]:
    """``vocab.json`` (piece -> id), checked: ids are distinct integers 0..V-1."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QkvError(f"{path}: not a readable JSON vocabulary: {e}") from None
    except RecursionError:
        raise QkvError(f"{path}: not a readable JSON vocabulary: nested too deeply") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
        raise QkvError(f"{path}: expected a JSON object mapping pieces to integer ids")
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise QkvError(f"{path}: the ids must be 0..{len(ids) - 1}, each once")
    return vocab


def _bos_name(pieces: list[str]) -> str:
    return next(n for n in ("<s>", "<qkv-bos>", "<qkv-bos-2>") if n not in pieces)


def marian_index(rows: list[int]) -> list[int]:
    """The inverse of :func:`marian_rows`: the qkv id of each Marian id. ``<pad>`` is BOS's row, the
    one a Marian decoder reads first (after fine-tuning it differs from PAD's, which no loss reaches)."""
    inverse = [0] * (len(rows) - 1)
    for q, m in enumerate(rows):
        if q != PAD:
            inverse[m] = q
    return inverse


class MarianSide:
    """One side (source or target) of a Marian tokenizer, on the interface of
    :class:`qkv.data.tokenizer.Tokenizer`: its SentencePiece model segments, the shared
    vocabulary numbers the pieces in qkv's order."""

    def __init__(self, spm_bytes: bytes, pieces: list[str], source: str) -> None:
        if not spm_bytes:
            raise QkvError(f"{source}: empty (not a SentencePiece model)")
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
        except RuntimeError:
            raise QkvError(f"{source}: not a valid SentencePiece model") from None
        if self.sp.get_piece_size() == 0:
            raise QkvError(f"{source}: not a valid SentencePiece model (no pieces)")
        self.model_bytes = spm_bytes
        # qkv id -> piece; BOS (a second <pad> row) is named "<s>" so that every id has its own piece
        self.pieces = [p if i != BOS else _bos_name(pieces) for i, p in enumerate(pieces)]
        self.ids = {p: i for i, p in enumerate(pieces) if i != BOS}  # piece -> qkv id (pad stays PAD)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    has_specials = False

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (PAD, UNK, BOS, EOS)

    def require_specials(self, task: str) -> None:
        raise QkvError(f"task {task!r} needs <cls>, [MASK], <sep> pieces; a Marian (OPUS-MT) vocabulary has none")

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> qkv ids, without EOS (as MarianTokenizer's ids, remapped, less its final ``</s>``)."""
        out = []
        for text in texts:
            code = []
            if text.startswith(">>") and (end := text.find("<<")) != -1:  # a language code: one token
                code, text = [text[: end + 2]], text[end + 2:]
            out.append([self.ids.get(p, UNK) for p in code + self.sp.encode(text, out_type=str)])
        return out

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """qkv ids -> texts: cut at the first EOS, PAD and BOS dropped, the pieces joined by SentencePiece."""
        return [self.sp.decode_pieces([self.pieces[i] for i in until_eos(row) if i not in (PAD, BOS)]).strip()
                for row in ids]

    def piece_ids(self, pieces: Sequence[str], where: str) -> list[int]:
        out = []
        for p in pieces:
            i = self.ids.get(p) if isinstance(p, str) else None
            if i is None:
                raise QkvError(f"{where}: {p!r} is not a piece of this tokenizer")
            if i in (PAD, BOS, EOS):
                raise QkvError(f"{where}: {p!r} is a special piece, not one a target can hold")
            out.append(i)
        return out

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i]

    def __repr__(self) -> str:
        return f"MarianSide(vocab_size={self.vocab_size})"


class MarianTokenizerPair(TokenizerPair):
    """Marian's ``source.spm`` / ``target.spm`` over one ``vocab.json``: a joint vocabulary (one
    embedding matrix) with a SentencePiece model per side. Saved as the original files plus
    ``marian_specials.json`` (the pieces of PAD, UNK and EOS)."""

    def __init__(self, src: MarianSide, tgt: MarianSide, vocab: dict[str, int], specials: dict[str, str]) -> None:
        super().__init__(src, tgt)
        self.vocab, self.specials = vocab, specials

    @property
    def joint(self) -> bool:
        return True  # one vocab.json: one vocabulary, whatever the two segmenters

    @property
    def rows(self) -> list[int]:
        return marian_rows(self.vocab, self.specials["pad"], self.specials["unk"], self.specials["eos"])

    @classmethod
    def from_files(cls, directory: str | Path, specials: dict[str, str]) -> "MarianTokenizerPair":
        """Read ``source.spm``, ``target.spm`` and ``vocab.json`` from ``directory``; ``specials``
        names the pieces of pad, unk and eos (each must be in the vocabulary)."""
        d = Path(directory)
        for name in (SOURCE_SPM, TARGET_SPM, VOCAB):
            if not (d / name).is_file():
                raise QkvError(f"{d / name}: missing (a Marian model folder has source.spm, target.spm and vocab.json)")
        vocab = read_vocab(d / VOCAB)
        for role in ("pad", "unk", "eos"):
            if specials.get(role) not in vocab:
                raise QkvError(f"{d / VOCAB}: has no {role} piece {specials.get(role)!r}")
        by_id = {i: p for p, i in vocab.items()}
        pieces = [by_id[i] for i in marian_rows(vocab, specials["pad"], specials["unk"], specials["eos"])]
        src = MarianSide((d / SOURCE_SPM).read_bytes(), pieces, str(d / SOURCE_SPM))
        tgt = MarianSide((d / TARGET_SPM).read_bytes(), pieces, str(d / TARGET_SPM))
        return cls(src, tgt, vocab, {k: specials[k] for k in ("pad", "unk", "eos")})

    @classmethod
    def load(cls, directory: str | Path, files: Collection[str] | None = None) -> "MarianTokenizerPair":
        d = Path(directory)
        try:
            specials = json.loads((d / SPECIALS).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise QkvError(f"{d / SPECIALS}: not readable: {e}") from None
        if not isinstance(specials, dict):
            raise QkvError(f"{d / SPECIALS}: expected a JSON object naming the pad, unk and eos pieces")
        return cls.from_files(d, specials)

    @classmethod
    def load_pair(cls, directory: str | Path) -> "MarianTokenizerPair":
        return cls.load(directory)

    @staticmethod
    def present(directory: str | Path, files: Collection[str] | None = None) -> bool:
        d = Path(directory)
        return all((d / n).is_file() and (files is None or n in files) for n in FILES)

    def files(self) -> list[str]:
        return list(FILES)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / SOURCE_SPM).write_bytes(self.src.model_bytes)
        (d / TARGET_SPM).write_bytes(self.tgt.model_bytes)
        (d / VOCAB).write_text(json.dumps(self.vocab, ensure_ascii=False), encoding="utf-8")
        (d / SPECIALS).write_text(json.dumps(self.specials, ensure_ascii=False), encoding="utf-8")

    def __repr__(self) -> str:
        return f"MarianTokenizerPair(joint vocab.json, vocab_size={self.src.vocab_size})"


__all__ = ["MarianSide", "MarianTokenizerPair", "marian_rows", "marian_index", "read_vocab", "FILES"]

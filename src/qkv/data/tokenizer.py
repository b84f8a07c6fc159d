"""Subword tokenizers: a thin wrapper around SentencePiece with qkv's fixed special ids.

The paper encodes WMT 2014 English-German "using byte-pair encoding [...] which has a shared
source-target vocabulary of about 37000 tokens" (section 5.1). :class:`Tokenizer` trains and
applies such a model (``bpe``, ``unigram`` or ``char``) with SentencePiece, always with the ids
``pad=0, unk=1, bos=2, eos=3`` of :mod:`qkv.config`. :class:`TokenizerPair` holds the source and
target tokenizers, which are one and the same object when the vocabulary is joint.

Training happens in memory (SentencePiece reads an iterator and writes the model into a buffer);
the serialized model bytes are kept, so ``save`` writes exactly the trained model.
Small corpora are fine: ``hard_vocab_limit=False`` lets SentencePiece return a smaller
vocabulary than asked for when the text does not support more pieces.

The monolingual tasks (classify, mlm, lm, prefix_lm) train with ``specials=True``: the pieces
``<cls>``, ``[MASK]`` and ``<sep>`` become user-defined symbols at the fixed ids
``CLS, MASK, SEP = 4, 5, 6`` of :mod:`qkv.config` (right after the four specials), so every task
agrees on them, and ``[MASK]`` typed in a text is that one piece. Translation tokenizers are
trained without them, exactly as before; :meth:`Tokenizer.has_specials` tells the two apart,
so older checkpoints load unchanged.
"""

from __future__ import annotations

import io
import unicodedata
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from qkv.config import BOS, CLS, CLS_PIECE, EOS, MASK, MASK_PIECE, PAD, SEP, SEP_PIECE, UNK
from qkv.errors import QkvError

MODEL_TYPES = ("bpe", "unigram", "char")
# Tokenizer backends of imported pretrained models (qkv.data.pretrained says what one offers): the files a
# checkpoint holds for it -> "module:Class" with load_pair(directory) / save_pair(pair, directory).
BACKENDS: dict[tuple[str, ...], str] = {
    ("tokenizer.json", "tokenizer_ids.json"): "qkv.data.pretrained:HFTokenizer",
    ("source.spm", "target.spm", "vocab.json", "marian_specials.json"): "qkv.data.marian_tokenizer:MarianTokenizerPair",
}
SPECIAL_PIECES = {CLS: CLS_PIECE, MASK: MASK_PIECE, SEP: SEP_PIECE}
SP_THREADED_FROM = 1024  # texts: SentencePiece's batch calls start a thread pool, ~0.6 ms a call


def until_eos(row: Iterable[int]) -> list[int]:
    """A row of ids up to its first EOS (EOS and everything after it cut)."""
    row = list(row)
    return row[: row.index(EOS)] if EOS in row else row


def sp_threads(n: int) -> int:
    """Threads for a SentencePiece batch call of ``n`` texts: one below :data:`SP_THREADED_FROM` (its
    pool costs more than it saves there: a sentence takes microseconds; a translation call of one
    sentence spent 0.6 ms encoding and 0.6 ms decoding), SentencePiece's default (every core) above."""
    return 1 if n < SP_THREADED_FROM else -1


class Tokenizer:
    """One SentencePiece model: text <-> lists of ids, with ``pad=0, unk=1, bos=2, eos=3``."""

    def __init__(self, model_bytes: bytes, source: str = "<memory>") -> None:
        """Load a serialized SentencePiece model; ``source`` names it in error messages."""
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError:
            raise QkvError(f"{source}: not a valid SentencePiece model") from None
        specials = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if specials != (PAD, UNK, BOS, EOS):
            raise QkvError(
                f"{source}: tokenizer has special ids pad/unk/bos/eos = {specials}, "
                f"qkv needs {(PAD, UNK, BOS, EOS)}"
            )
        self.model_bytes = model_bytes

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        model_type: str = "bpe",
        character_coverage: float = 1.0,
        specials: bool = False,
        byte_fallback: bool = False,
        input_sentence_size: int = 0,
        seed: int = 1,
    ) -> "Tokenizer":
        """Train a SentencePiece model on ``texts`` (one sentence per item), silently.

        ``vocab_size`` counts the four special pieces. It is an upper bound: a corpus too small
        for that many pieces gets fewer (``hard_vocab_limit=False``). For ``model_type="char"``
        the vocabulary is exactly the characters the corpus needs, whatever ``vocab_size`` says.
        A ``vocab_size`` smaller than the corpus' characters (+4 specials) is a :class:`QkvError`.
        ``specials``: also reserve ``<cls>``, ``[MASK]``, ``<sep>`` at ids 4, 5, 6.

        For large corpora (``qkv preprocess``): ``input_sentence_size`` > 0 streams ``texts`` (never
        held in a list) and SentencePiece learns from a random sample of that many sentences
        (``shuffle_input_sentence``, seeded by ``seed``); ``byte_fallback`` spells a character the
        vocabulary lacks as its UTF-8 bytes (pieces ``<0x00>``..``<0xFF>``) instead of ``<unk>``.
        Models trained without these options load and encode exactly as before.
        """
        if model_type not in MODEL_TYPES:
            raise QkvError(f"unknown tokenizer model type {model_type!r}; choose one of {', '.join(MODEL_TYPES)}")
        extra: dict = {"user_defined_symbols": [SPECIAL_PIECES[i] for i in sorted(SPECIAL_PIECES)]} if specials else {}
        if input_sentence_size > 0 and model_type != "char":
            seen = [False]

            def stream():
                for t in texts:
                    if t.strip():
                        seen[0] = True
                        yield t

            sentences = stream()
            extra.update(input_sentence_size=max(input_sentence_size, 101), shuffle_input_sentence=True)  # its minimum
            spm.set_random_generator_seed(seed)
        else:
            sentences = [t for t in texts if t.strip()]
            seen = [bool(sentences)]
            if not sentences:
                raise QkvError("cannot train a tokenizer on an empty corpus")
            if model_type == "char":
                vocab_size = _char_vocab_bound(sentences) + (len(SPECIAL_PIECES) if specials else 0)
            sentences = iter(sentences)
        if byte_fallback:
            extra["byte_fallback"] = True
            vocab_size = vocab_size + 256 if model_type == "char" else \
                max(vocab_size, 4 + 256 + 1 + len(extra.get("user_defined_symbols", ())))
        buffer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences,
                model_writer=buffer,
                model_type=model_type,
                vocab_size=vocab_size,
                character_coverage=character_coverage,
                hard_vocab_limit=False,
                pad_id=PAD,
                unk_id=UNK,
                bos_id=BOS,
                eos_id=EOS,
                minloglevel=2,  # errors only: training is silent
                **extra,
            )
        except RuntimeError as e:
            if not seen[0]:
                raise QkvError("cannot train a tokenizer on an empty corpus") from None
            raise QkvError(f"tokenizer training failed ({model_type}, vocab_size={vocab_size}): {e}") from None
        tok = cls(buffer.getvalue())
        if specials and not tok.has_specials:
            raise QkvError("tokenizer training did not place <cls>, [MASK], <sep> at ids 4, 5, 6")
        return tok

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a model written by :meth:`save` (or any SentencePiece ``.model`` with qkv's ids)."""
        p = Path(path)
        if not p.is_file():
            raise QkvError(f"tokenizer model not found: {p}")
        return cls(p.read_bytes(), source=str(p))

    def save(self, path: str | Path) -> None:
        """Write the serialized model (the exact bytes that were trained or loaded)."""
        Path(path).write_bytes(self.model_bytes)

    # --- use --------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of pieces, the four special ones included."""
        return self.sp.get_piece_size()

    @property
    def has_specials(self) -> bool:
        """True when ``<cls>``, ``[MASK]``, ``<sep>`` sit at their fixed ids 4, 5, 6."""
        return all(i < self.vocab_size and self.sp.id_to_piece(i) == piece for i, piece in SPECIAL_PIECES.items())

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The ids of the special pieces: PAD, UNK, BOS, EOS, and ``<cls>``, ``[MASK]``, ``<sep>``
        where this model has them (:attr:`has_specials`); every other id is an ordinary piece."""
        return (PAD, UNK, BOS, EOS) + (tuple(sorted(SPECIAL_PIECES)) if self.has_specials else ())

    def require_specials(self, task: str) -> None:
        """Raise a clear error when a task needs ``<cls>``/``[MASK]``/``<sep>`` and this model lacks them."""
        if not self.has_specials:
            raise QkvError(f"task {task!r} needs a tokenizer with <cls>, [MASK], <sep> at ids 4, 5, 6; this one "
                           "(trained for translation) has none: train the model with --task " + task)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> ids, without BOS/EOS (``collate`` adds those)."""
        texts = list(texts)
        return self.sp.encode(texts, out_type=int, num_threads=sp_threads(len(texts)))

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Ids -> texts. Everything from the first EOS on is cut; PAD and BOS are dropped."""
        cleaned = [[i for i in until_eos(row) if i not in (PAD, BOS)] for row in ids]
        return self.sp.decode(cleaned, num_threads=sp_threads(len(cleaned)))

    def piece_ids(self, pieces: Sequence[str], where: str) -> list[int]:
        """The ids of ``pieces`` (e.g. the ``tokens`` of a translation), unchanged: no re-segmentation.
        A piece this model lacks, or PAD, BOS or EOS, is a :class:`QkvError` naming ``where``."""
        ids = []
        for p in pieces:
            i = self.sp.piece_to_id(p) if isinstance(p, str) else UNK
            if i == UNK and p != self.sp.id_to_piece(UNK):
                raise QkvError(f"{where}: {p!r} is not a piece of this tokenizer")
            if i in (PAD, BOS, EOS):
                raise QkvError(f"{where}: {p!r} is a special piece, not one a target can hold")
            ids.append(i)
        return ids

    def id_to_piece(self, i: int) -> str:
        """The piece for id ``i``, e.g. ``'▁Haus'`` (for display)."""
        return self.sp.id_to_piece(i)

    def piece_text(self, i: int) -> str:
        """The text of piece ``i`` as a word, e.g. ``'Haus'`` (for display)."""
        return self.sp.decode([i]) or self.id_to_piece(i)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def _char_vocab_bound(sentences: list[str]) -> int:
    """An upper bound on a character model's vocabulary: specials + '▁' + every character.

    Characters are counted before and after NFKC normalization (which SentencePiece applies),
    since normalization can create characters (e.g. '½' -> '1⁄2').
    """
    chars: set[str] = set()
    for s in sentences:
        chars.update(s)
        chars.update(unicodedata.normalize("NFKC", s))
    return 4 + 1 + len(chars)


class TokenizerPair:
    """Source and target tokenizers; ``src is tgt`` when the vocabulary is joint (shared)."""

    JOINT_FILE = "spm.model"
    SRC_FILE = "spm.src.model"
    TGT_FILE = "spm.tgt.model"

    def __init__(self, src: Tokenizer, tgt: Tokenizer) -> None:
        self.src = src
        self.tgt = tgt

    @property
    def joint(self) -> bool:
        """True when source and target share one model (and so one vocabulary)."""
        return self.src is self.tgt

    @classmethod
    def train(
        cls,
        src_texts: Sequence[str],
        tgt_texts: Sequence[str],
        vocab_size: int,
        model_type: str = "bpe",
        joint: bool = True,
        character_coverage: float = 1.0,
        specials: bool = False,
    ) -> "TokenizerPair":
        """Train one model on both sides (``joint``) or one model per side."""
        if joint:
            shared = Tokenizer.train([*src_texts, *tgt_texts], vocab_size, model_type, character_coverage, specials)
            return cls(shared, shared)
        src = Tokenizer.train(src_texts, vocab_size, model_type, character_coverage, specials)
        tgt = Tokenizer.train(tgt_texts, vocab_size, model_type, character_coverage, specials)
        return cls(src, tgt)

    def files(self) -> list[str]:
        """Names of the files :meth:`save` writes."""
        if hasattr(self.src, "FILES"):  # an imported model's tokenizer (BACKENDS)
            return list(self.src.FILES)
        return [self.JOINT_FILE] if self.joint else [self.SRC_FILE, self.TGT_FILE]

    def save(self, directory: str | Path) -> None:
        """Write ``spm.model`` (joint) or ``spm.src.model`` + ``spm.tgt.model`` into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if hasattr(self.src, "save_pair"):  # an imported model's tokenizer (BACKENDS)
            self.src.save_pair(self, d)
            return
        if self.joint:
            self.src.save(d / self.JOINT_FILE)
        else:
            self.src.save(d / self.SRC_FILE)
            self.tgt.save(d / self.TGT_FILE)

    @classmethod
    def load(cls, directory: str | Path, files: Collection[str] | None = None) -> "TokenizerPair":
        """Read whichever layout :meth:`save` wrote into ``directory``. ``files``: the names a
        checkpoint's manifest lists; only those count (a model file copied in beside them is not
        part of the checkpoint and is never read). None: whatever the directory holds."""
        d = Path(directory)

        def present(name: str) -> bool:
            return (d / name).is_file() and (files is None or name in files)

        for names, where in BACKENDS.items():
            if all(present(n) for n in names):
                import importlib

                module, name = where.split(":")
                return getattr(importlib.import_module(module), name).load_pair(d)
        if present(cls.JOINT_FILE):
            shared = Tokenizer.from_file(d / cls.JOINT_FILE)
            return cls(shared, shared)
        if present(cls.SRC_FILE) and present(cls.TGT_FILE):
            return cls(Tokenizer.from_file(d / cls.SRC_FILE), Tokenizer.from_file(d / cls.TGT_FILE))
        if files is None and (present(cls.SRC_FILE) or present(cls.TGT_FILE)):
            missing = cls.TGT_FILE if present(cls.SRC_FILE) else cls.SRC_FILE
            raise QkvError(f"tokenizer model not found: {d / missing}")
        raise QkvError(
            f"{d}: no tokenizer found (expected {cls.JOINT_FILE}, or {cls.SRC_FILE} and {cls.TGT_FILE}"
            + (", listed in its manifest)" if files is not None else ")")
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "TokenizerPair":
        """An existing tokenizer to reuse: a checkpoint (or tokenizer) directory, or one SentencePiece
        ``.model`` file (used for both sides, a joint vocabulary)."""
        p = Path(path)
        if p.is_dir():
            return cls.load(p)
        if p.is_file():
            shared = Tokenizer.from_file(p)
            return cls(shared, shared)
        raise QkvError(f"{p}: no such tokenizer (give a checkpoint directory or a SentencePiece .model file)")

    def __repr__(self) -> str:
        if self.joint:
            return f"TokenizerPair(joint, vocab_size={self.src.vocab_size})"
        return f"TokenizerPair(src vocab_size={self.src.vocab_size}, tgt vocab_size={self.tgt.vocab_size})"

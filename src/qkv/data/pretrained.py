"""Tokenizers of imported pretrained models, beside qkv's own SentencePiece models.

qkv's code everywhere relies on fixed special ids (:mod:`qkv.config`): ``PAD, UNK, BOS, EOS = 0, 1, 2, 3``
and ``CLS, MASK, SEP = 4, 5, 6``. A pretrained model numbers its vocabulary its own way (BERT: ``[PAD]``
0, ``[UNK]`` 100, ``[CLS]`` 101, ``[SEP]`` 102, ``[MASK]`` 103). qkv **remaps rows**: an imported model's
tokens get qkv ids by an :class:`IdMap`, a permutation of the model's ids that puts each special token
the model has at qkv's id for it and keeps every other token in the model's order after them; a
special role the model lacks (BERT has no BOS or EOS) gets a row of its own. The importer permutes the
embedding rows (and every per-token output row and bias) the same way, so the network computes what
the original computes, every qkv code path keeps its fixed ids, and the tokenizer maps ids on the way
in and out. The map is saved beside the model's tokenizer files (``tokenizer_ids.json``).

:class:`HFTokenizer` is the backend over Hugging Face ``tokenizers`` (a ``tokenizer.json``:
WordPiece, byte-level BPE, ...). Its :meth:`~HFTokenizer.encode` gives a text's tokens followed by the
special tokens the model's post-processor puts after a single text (BERT's ``[SEP]``); the token it
puts before (``[CLS]``) is qkv's CLS, which the encoder tasks put first themselves.

A tokenizer backend offers what :class:`qkv.data.tokenizer.Tokenizer` offers: ``vocab_size``,
``has_specials``, ``special_ids``, ``require_specials``, ``encode``, ``decode``, ``piece_ids``,
``id_to_piece``, ``piece_text``, ``model_bytes`` (identity: equal bytes, equal tokenization); and, to be
saved in a checkpoint, ``FILES`` (the names it writes), ``save_pair(pair, directory)`` and
``load_pair(directory)``, registered in :data:`qkv.data.tokenizer.BACKENDS`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.config import BOS, CLS, EOS, MASK, PAD, SEP, UNK
from qkv.data.tokenizer import until_eos
from qkv.errors import QkvError

SLOTS = (PAD, UNK, BOS, EOS, CLS, MASK, SEP)  # qkv's special ids, 0..6
SLOT_NAMES = {PAD: "pad", UNK: "unk", BOS: "bos", EOS: "eos", CLS: "cls", MASK: "mask", SEP: "sep"}
ADDED_PIECES = {PAD: "<pad>", UNK: "<unk>", BOS: "<s>", EOS: "</s>", CLS: "<cls>", MASK: "[MASK]", SEP: "<sep>"}


@dataclass(frozen=True)
class IdMap:
    """qkv id -> the model's id (``None``: a row the model lacks, added for one of qkv's special roles).

    qkv ids 0..6 are the special slots; the model's other ids follow in their own order."""

    model_ids: tuple[int | None, ...]

    @classmethod
    def build(cls, model_vocab_size: int, roles: Mapping[int, int | None]) -> "IdMap":
        """``roles``: qkv special id -> the model's token id for that role, or None (the model has
        none: a new row). A model id may fill one role only."""
        used = [roles.get(s) for s in SLOTS]
        taken = [i for i in used if i is not None]
        if len(set(taken)) != len(taken):
            raise QkvError(f"one token of the model cannot fill two of qkv's special roles: {dict(roles)}")
        for i in taken:
            if not 0 <= i < model_vocab_size:
                raise QkvError(f"special token id {i} is outside the model's vocabulary of {model_vocab_size}")
        rest = [i for i in range(model_vocab_size) if i not in set(taken)]
        return cls(tuple(used) + tuple(rest))

    @property
    def size(self) -> int:
        return len(self.model_ids)

    @property
    def to_qkv(self) -> dict[int, int]:
        """The model's id -> qkv's."""
        return {m: q for q, m in enumerate(self.model_ids) if m is not None}

    def rows(self, weight: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """A per-token tensor of the model (rows = its ids, e.g. the embedding matrix or an output bias)
        with its rows in qkv's order; an added row is ``fill``."""
        out = weight.new_full((self.size, *weight.shape[1:]), fill)
        have = [q for q, m in enumerate(self.model_ids) if m is not None]
        out[have] = weight[[self.model_ids[q] for q in have]]
        return out

    def to_json(self) -> dict:
        return {"model_ids": list(self.model_ids)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> "IdMap":
        ids = data.get("model_ids") if isinstance(data, dict) else None
        if not isinstance(ids, list) or len(ids) < len(SLOTS) or not all(i is None or (isinstance(i, int) and i >= 0)
                                                                        for i in ids):
            raise QkvError(f"{source}: 'model_ids' must be a list of token ids (or null) of at least {len(SLOTS)}")
        taken = [i for i in ids if i is not None]
        if len(set(taken)) != len(taken):
            raise QkvError(f"{source}: 'model_ids' names a model id twice")
        return cls(tuple(ids))


def _hf():
    try:
        import tokenizers
    except ImportError:
        raise QkvError("this model's tokenizer is a Hugging Face tokenizer.json: install the 'tokenizers' package "
                       '(pip install -c constraints.txt -e ".[pretrained]")') from None
    return tokenizers


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` with qkv's ids (:class:`IdMap`) and the model's suffix tokens."""

    FILE, IDS_FILE = "tokenizer.json", "tokenizer_ids.json"
    FILES = (FILE, IDS_FILE)

    def __init__(self, tokenizer_json: bytes, ids_json: bytes, source: str = "<memory>") -> None:
        self.tok = _tokenizer(tokenizer_json, f"{source}/{self.FILE}")
        self.tok.no_truncation()
        self.tok.no_padding()
        meta = _json(ids_json, f"{source}/{self.IDS_FILE}")
        self.ids = IdMap.from_json(meta, f"{source}/{self.IDS_FILE}")
        vocab = self.tok.get_vocab_size(with_added_tokens=True)
        if any(m is not None and m >= vocab for m in self.ids.model_ids):
            raise QkvError(f"{source}/{self.IDS_FILE}: ids beyond the tokenizer's vocabulary of {vocab}")
        self._to_qkv = self.ids.to_qkv
        suffix = meta.get("suffix", [])
        if not isinstance(suffix, list) or any(not isinstance(i, int) or i not in self._to_qkv for i in suffix):
            raise QkvError(f"{source}/{self.IDS_FILE}: 'suffix' must list token ids of the tokenizer, got {suffix!r}")
        self.suffix = [self._to_qkv[i] for i in suffix]
        prefix = meta.get("prefix", [])  # put before every text (BART's <s>; an encoder's CLS is qkv's own)
        if not isinstance(prefix, list) or any(not isinstance(i, int) or i not in self._to_qkv for i in prefix):
            raise QkvError(f"{source}/{self.IDS_FILE}: 'prefix' must list token ids of the tokenizer, got {prefix!r}")
        self.prefix = [self._to_qkv[i] for i in prefix]
        # qkv writes a mask as [MASK] (fill); a model whose mask token is another (RoBERTa's <mask>) reads its own
        mask = self.ids.model_ids[MASK]
        self._mask = self.tok.id_to_token(mask) if mask is not None else None
        self.model_bytes = tokenizer_json + b"\0" + ids_json
        self._json, self._ids_json = tokenizer_json, ids_json
        self.tokenizer_json = tokenizer_json  # the model's own tokenizer.json, as it came (what an export copies)

    @classmethod
    def create(cls, tokenizer_json: bytes, roles: Mapping[int, int | None], suffix: Sequence[int] = (),
               source: str = "<memory>", prefix: Sequence[int] = ()) -> "HFTokenizer":
        """A new one over ``tokenizer_json``; ``roles`` (qkv special id -> the model's id) and ``suffix``
        (the model's ids put after every text) as :class:`IdMap` and the importers decide them."""
        vocab = _tokenizer(tokenizer_json, source).get_vocab_size(with_added_tokens=True)
        try:
            ids = IdMap.build(vocab, roles)
        except QkvError as e:
            raise QkvError(f"{source}: {e}") from None
        meta = {**ids.to_json(), "suffix": list(suffix), **({"prefix": list(prefix)} if prefix else {})}
        return cls(tokenizer_json, json.dumps(meta).encode("utf-8"), source)

    # --- saving, as both sides of a TokenizerPair (one vocabulary) ---------------------------------------

    def save_pair(self, pair, directory: str | Path) -> None:
        if pair.tgt is not pair.src:
            raise QkvError("a tokenizer.json model is one vocabulary: source and target must be the same")
        d = Path(directory)
        (d / self.FILE).write_bytes(self._json)
        (d / self.IDS_FILE).write_bytes(self._ids_json)

    @classmethod
    def load_pair(cls, directory: str | Path):
        from qkv.data.tokenizer import TokenizerPair

        d = Path(directory)
        tok = cls((d / cls.FILE).read_bytes(), (d / cls.IDS_FILE).read_bytes(), str(d))
        return TokenizerPair(tok, tok)

    # --- use ------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.ids.size

    has_specials = True  # qkv's ids 0..6 always exist (the model's tokens, or rows of their own)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return SLOTS

    def require_specials(self, task: str) -> None:
        pass

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> qkv ids: the model's prefix (BART's ``<s>``), its tokens of each text (its normaliser and pre-tokenizer; special
        tokens written in the text, such as ``[MASK]``, are those tokens; ``[MASK]`` is the model's mask
        token whatever its name, RoBERTa's ``<mask>``), then the model's suffix."""
        out = []
        if self._mask not in (None, "[MASK]"):
            texts = [t.replace("[MASK]", self._mask) for t in texts]
        for enc in self.tok.encode_batch(list(texts), add_special_tokens=False):
            out.append(self.prefix + [self._to_qkv[i] for i in enc.ids] + self.suffix)
        return out

    def encode_text(self, text: str) -> list[int]:
        """One text as the model's own tokenizer reads it: whole (a line break is the model's token, not
        qkv's end of a line), with the special tokens its post-processor puts around a single text
        (Llama's ``<s>`` first). What a language model's prompt is."""
        return [self._to_qkv[i] for i in self.tok.encode(text, add_special_tokens=True).ids]

    def to_model_ids(self, ids: Sequence[int]) -> list[int | None]:
        """qkv ids -> the model's (None for a row the model lacks)."""
        return [self.ids.model_ids[i] for i in ids]

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """qkv ids -> texts. Everything from the first EOS on is cut; special tokens are dropped."""
        texts = []
        for row in ids:
            model = [m for m in self.to_model_ids(i for i in until_eos(row) if i >= len(SLOTS)) if m is not None]
            texts.append(self.tok.decode(model, skip_special_tokens=True))
        return texts

    def piece_ids(self, pieces: Sequence[str], where: str) -> list[int]:
        ids = []
        for p in pieces:
            m = self.tok.token_to_id(p) if isinstance(p, str) else None
            if m is None or m not in self._to_qkv:
                raise QkvError(f"{where}: {p!r} is not a piece of this tokenizer")
            q = self._to_qkv[m]
            if q in (PAD, BOS, EOS):
                raise QkvError(f"{where}: {p!r} is a special piece, not one a target can hold")
            ids.append(q)
        return ids

    def id_to_piece(self, i: int) -> str:
        m = self.ids.model_ids[i]
        return ADDED_PIECES[i] if m is None else self.tok.id_to_token(m)

    def piece_text(self, i: int) -> str:
        """The text of one piece as a word (``##ing`` -> ``ing``), for display."""
        m = self.ids.model_ids[i]
        return (self.tok.decode([m], skip_special_tokens=False) if m is not None else "") or self.id_to_piece(i)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


# --- what a model folder says about its special tokens ----------------------------------------------------

def special_token_names(folder: str | Path) -> dict[str, str]:
    """The model's special tokens by role (``pad``, ``unk``, ``bos``, ``eos``, ``cls``, ``sep``, ``mask``), from
    its ``special_tokens_map.json`` and ``tokenizer_config.json`` (``*_token`` entries, a string or
    ``{"content": ...}``); the first file that names a role wins."""
    names: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = Path(folder) / name
        if not p.is_file():
            continue
        data = _json(p.read_bytes(), p)
        for role in SLOT_NAMES.values():
            value = data.get(f"{role}_token") if isinstance(data, dict) else None
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and role not in names:
                names[role] = value
    return names


def _json(raw: bytes, where) -> object:
    """``raw`` as JSON, or a QkvError naming ``where`` (not UTF-8, not JSON, nested too deep)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QkvError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise QkvError(f"{where}: JSON nested too deeply to read") from None


def _tokenizer(tokenizer_json: bytes, where: str):
    try:
        return _hf().Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except QkvError:
        raise
    except Exception as e:  # tokenizers raises its own Exception subclass
        lines = [s for s in str(e).splitlines() if s.strip()]
        raise QkvError(f"{where}: not a Hugging Face tokenizer ({lines[0] if lines else type(e).__name__})") from None


def roles(tokenizer_json: bytes, names: Mapping[str, str], where: str) -> dict[int, int | None]:
    """qkv special id -> the model's id of the token ``names`` gives that role (None: no such role); a
    name the tokenizer does not know is refused."""
    tok = _tokenizer(tokenizer_json, where)
    out: dict[int, int | None] = {}
    for slot, role in SLOT_NAMES.items():
        name = names.get(role)
        i = tok.token_to_id(name) if name is not None else None
        if name is not None and i is None:
            raise QkvError(f"{where}: its {role} token {name!r} is not in tokenizer.json")
        out[slot] = i
    return out


def single_template(tokenizer_json: bytes, where: str) -> tuple[list[int], list[int]]:
    """The model's ids the post-processor puts before and after a single text (BERT: [CLS] / [SEP]);
    ([], []) without a post-processor (GPT-2's byte-level one adds nothing)."""
    data = _json(tokenizer_json, where)
    post = (data.get("post_processor") if isinstance(data, dict) else None) or {}
    vocab = None

    def token_ids(ids) -> list[int]:
        nonlocal vocab
        if vocab is None:
            vocab = _tokenizer(tokenizer_json, where).get_vocab_size(with_added_tokens=True)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                for i in ids):
            raise ValueError(f"token ids {str(ids)[:40]} are not ids of its {vocab} tokens")
        return ids

    def template(post, depth: int = 0) -> tuple[list[int], list[int]] | None:
        kind = post.get("type") if isinstance(post, dict) else "?"
        if kind in (None, "ByteLevel"):
            return [], []
        try:
            if kind in ("BertProcessing", "RobertaProcessing"):  # [CLS] X [SEP]; RoBERTa's <s> X </s>
                return token_ids([post["cls"][1]]), token_ids([post["sep"][1]])
            if kind == "Sequence" and depth < 8:  # processors applied in turn (a ByteLevel one adds no token)
                before, after = [], []
                steps = post.get("processors", [])
                if not isinstance(steps, list):
                    raise ValueError("its processors must be a list")
                for step in steps:
                    b, a = template(step, depth + 1)
                    before, after = b + before, after + a
                return before, after
            if kind == "TemplateProcessing":
                before, after, seen = [], [], False
                for item in post.get("single", []):
                    if "Sequence" in item:
                        seen = True
                        continue
                    token = item["SpecialToken"]["id"]
                    ids = token_ids(post["special_tokens"][token]["ids"])
                    (after if seen else before).extend(ids)
                return before, after
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__} {str(e)[:60]}".strip()
            raise QkvError(f"{where}: its post_processor ({kind}) is malformed ({why})") from None
        raise QkvError(f"{where}: tokenizer.json post-processor {kind!r} is not supported (TemplateProcessing, "
                       "BertProcessing, RobertaProcessing, ByteLevel or a Sequence of them)")

    return template(post)

"""The encoder front-end: what ``qkv.load`` returns for a classify or mlm checkpoint.

    >>> enc = qkv.load("runs/imdb/best")
    >>> enc.classify(["this movie is so great"])
    [('pos', 0.97)]
    >>> qkv.load("runs/imdb-mlm/best").fill("the movie was [MASK]", k=3)
    [[('great', 0.21), ('good', 0.12), ('bad', 0.08)]]

Texts are cleaned as the training data were (:func:`qkv.data.labelled.clean_text`, where the run's
``clean_html`` says so; an imported model reads them as given), tokenized,
truncated to the model's ``max_len`` as in training (the head, or head + tail with ``keep_tail``) and run
in batches of similar length.
Embeddings (:meth:`Encoder.embed`) pool the encoder states: the ``<cls>`` state or the mean over
the valid positions; :meth:`Encoder.search` ranks a corpus by cosine similarity to a query,

    cos(q, d) = q·d / (‖q‖ ‖d‖).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv.config import MASK, TrainConfig
from qkv.data.labelled import clean_text
from qkv.data.tokenizer import TokenizerPair
from qkv.decoding.greedy import banned_ids, log_probs
from qkv.errors import QkvError
from qkv.frontends.base import Frontend, TruncationHandler
from qkv.metrics import accuracy, confusion_matrix, f1_per_class, format_confusion, macro_f1
from qkv.tasks.classify import encoder_input, truncate


class Encoder(Frontend):
    """A trained encoder-only (or recurrent) model with its tokenizer and, for a classifier, its labels."""

    name = "encoder"

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, labels: list[str] | None = None,
                 train_cfg: TrainConfig | None = None, batch_size: int = 64, normalize: bool = False,
                 pooling: str | None = None, clean: bool | None = None):
        super().__init__(model, tokenizers, train_cfg)
        # <br /> -> space as in training (the run's clean_html); never for an imported model
        self.clean = self.train_cfg.clean_html if clean is None else clean
        # an imported sentence-transformers model's own embedding: its Pooling (mean | cls), its Normalize
        self.normalize, self.pooling = normalize, pooling
        self.labels = list(labels) if labels else None
        self.max_len = min(self.train_cfg.max_len, getattr(model.cfg, "max_positions", 10**9) - 1)
        self.keep_tail = min(self.train_cfg.keep_tail, self.max_len - 1)  # head + tail, as in training
        self.batch_size = batch_size

    @property
    def offers(self) -> frozenset[str]:
        """The task's offers, less "fill" for an encoder imported without its masked-LM head."""
        offers = super().offers
        return offers - {"fill"} if not getattr(self.model.cfg, "mlm_head", True) else offers

    @classmethod
    def from_checkpoint(cls, model, tokenizers, config, decode_cfg, train_cfg) -> "Encoder":
        sentence = config.get("sentence_embedding") or {}
        clean = None if not config.get("imported") else False  # an import written before clean_html was recorded
        return cls(model, tokenizers, config.get("labels"), train_cfg, normalize=bool(sentence.get("normalize")),
                   pooling=sentence.get("pooling"), clean=clean)

    def _ids(self, texts: list[str], on_truncate: TruncationHandler | None = None) -> list[list[int]]:
        """Token lists cut to ``max_len``; ``on_truncate(indices, max_len)`` hears which were cut."""
        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not a single string")
        # a blank text is read as the model reads any text: <cls> (+ the tokenizer's own suffix, an imported
        # BERT's [SEP]), as sentence-transformers embeds it
        ids = self.tokenizers.src.encode([clean_text(t, self.clean) for t in texts])
        cut = [i for i, row in enumerate(ids) if len(row) > self.max_len]
        if cut and on_truncate is not None:
            on_truncate(cut, self.max_len)
        return truncate(ids, self.max_len, getattr(self.tokenizers.src, "suffix", ()), self.keep_tail)[0]

    def _batches(self, ids: list[list[int]]):
        """(indices, (B, T) tokens on the device), similar lengths together."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            yield idx, encoder_input([ids[i] for i in idx]).to(self.device)

    def input_tokens(self, text: str) -> torch.Tensor:
        """One text as the model reads it: ``(1, T)`` = ``<cls>`` + its pieces, cleaned as the
        training data were and truncated to ``max_len``, on the model's device."""
        cleaned = clean_text(text, self.clean)
        if not cleaned.strip():
            raise QkvError("the text is empty")
        ids = self.tokenizers.src.encode([cleaned])[0]
        if "fill" in self.offers and hasattr(self.tokenizers.src, "sp"):
            # SentencePiece splits " [MASK]" into a lone "▁" and [MASK]; in training a mask replaces a
            # whole piece such as "▁great", so the lone "▁" goes.
            lone = self.tokenizers.src.sp.piece_to_id("▁")
            ids = [t for j, t in enumerate(ids) if not (t == lone and j + 1 < len(ids) and ids[j + 1] == MASK)]
        ids = truncate([ids], self.max_len, getattr(self.tokenizers.src, "suffix", ()), self.keep_tail)[0][0]
        return encoder_input([ids]).to(self.device)  # (1, T)

    # --- classify --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def probabilities(self, texts: list[str], on_truncate: TruncationHandler | None = None,
                      on_batch: Callable[[int], object] | None = None) -> torch.Tensor:
        """``(N, C)`` class probabilities, columns in the order of :attr:`labels`. A text longer than
        ``max_len`` tokens is classified as in training (its head, or head + tail); ``on_truncate(indices,
        max_len)`` hears which texts (0-based) were cut, ``on_batch(n)`` each batch of ``n`` texts done
        (a progress bar)."""
        if "classify" not in self.offers:
            raise QkvError(f"this is a {self.task!r} model, not a classifier (train one with --task classify)")
        self.model.eval()
        ids = self._ids(texts, on_truncate)
        out = torch.zeros(len(ids), len(self.labels))
        for idx, tokens in self._batches(ids):
            out[idx] = torch.softmax(self.model(tokens).float(), dim=-1).cpu()  # (B, C)
            if on_batch is not None:
                on_batch(len(idx))
        return out

    def classify_lines(self, lines: list[str], on_truncate: TruncationHandler | None = None,
                       chunk: int = 512) -> Iterator[torch.Tensor | None]:
        """The class probabilities of each line (None for an empty line), in order, ``chunk`` lines at
        a time so that output streams; ``on_truncate(indices, kept)`` hears indices into ``lines``."""
        for start in range(0, len(lines), chunk):
            part = lines[start : start + chunk]
            keep = [i for i, line in enumerate(part) if line.strip()]
            warn = None if on_truncate is None else \
                (lambda idx, kept, keep=keep, start=start: on_truncate([start + keep[i] for i in idx], kept))
            rows = dict(zip(keep, self.probabilities([part[i] for i in keep], on_truncate=warn))) if keep else {}
            for i in range(len(part)):
                yield rows.get(i)

    def evaluate(self, texts: list[str], labels: list[str], where: Callable[[int], str] | None = None,
                 on_batch: Callable[[int], object] | None = None) -> "ClassifierReport":
        """Accuracy, macro-F1 and the confusion matrix on labelled texts; a label the model does not
        know is an error naming ``where(i)`` (e.g. the file and line of example ``i``); ``on_batch(n)``
        hears each batch of ``n`` texts classified."""
        index = {label: i for i, label in enumerate(self.labels or [])}
        for i, label in enumerate(labels):
            if label not in index:
                raise QkvError(f"{where(i) if where else f'example {i + 1}'}: label {label!r} is not one of the "
                               f"model's labels ({', '.join(self.labels or [])})")
        golds = [index[label] for label in labels]
        preds = self.probabilities(texts, on_batch=on_batch).argmax(dim=-1).tolist()
        return ClassifierReport(list(self.labels), golds, preds)

    def classify(self, texts: list[str]) -> list[tuple[str, float]]:
        """The most probable label of each text and its probability."""
        probs = self.probabilities(texts)
        best = probs.argmax(dim=-1)
        return [(self.labels[int(c)], float(probs[i, c])) for i, c in enumerate(best)]

    # --- fill ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def fill(self, text: str, k: int = 5) -> list[list[tuple[str, float]]]:
        """For each ``[MASK]`` in ``text``, the ``k`` most probable pieces (as text) and their probabilities.

        A special piece (``[MASK]``, ``<cls>``, ``<s>``, ``</s>``, ...) is never offered: the decoders'
        rule (:func:`qkv.decoding.banned_ids`, EOS included since a fill has no end) sets its
        probability to 0 after the softmax, so the others keep the model's own probabilities."""
        if self.task == "mlm" and "fill" not in self.offers:
            raise QkvError("this encoder was imported without its masked-LM head (BertModel, RobertaModel, ... or "
                           "sentence-transformers): it embeds and searches; fill needs a ...ForMaskedLM "
                           "(BertForMaskedLM, RobertaForMaskedLM, ...)")
        if "fill" not in self.offers:
            raise QkvError(f"this is a {self.task!r} model: fill needs a masked language model (--task mlm)")
        if "[MASK]" not in text:
            raise QkvError('the text has no [MASK] to fill, e.g. "the movie was [MASK]"')
        self.model.eval()
        tokens = self.input_tokens(text)  # (1, T)
        where = (tokens[0] == MASK).nonzero().squeeze(1)
        banned = banned_ids(self.tokenizers.src, ends=False)
        probs = log_probs(self.model(tokens)[0, where], banned).exp()  # (M, V), 0 on the banned ids
        top = probs.topk(min(k, probs.size(-1) - len(banned)), dim=-1)
        out = []
        for values, indices in zip(top.values.tolist(), top.indices.tolist()):
            out.append([(self.tokenizers.src.piece_text(i), v)
                        for i, v in zip(indices, values)])
        return out

    # --- embed and search ------------------------------------------------------------------------------

    @property
    def default_pooling(self) -> str:
        """The pooling :meth:`embed` uses when given none: an imported sentence-transformers model's, a
        classifier's own, else "mean"."""
        return self.pooling or (self.model.cfg.pooling if "classify" in self.offers else "mean")

    @torch.inference_mode()
    def embed(self, texts: list[str], pooling: str | None = None) -> torch.Tensor:
        """``(N, d)`` sentence embeddings: ``pooling`` "mean" or "cls" (default: the model's own,
        "mean" for an mlm model, an imported sentence-transformers model's pooling); L2-normalised where the model says so (an imported
        sentence-transformers model with its Normalize module)."""
        self.model.eval()
        if pooling is None:
            pooling = self.default_pooling
        if pooling not in ("mean", "cls"):
            raise QkvError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        ids = self._ids(texts)
        out = None
        for idx, tokens in self._batches(ids):
            vectors = self.model.embed(tokens, pooling).float().cpu()  # (B, d)
            if self.normalize:
                vectors = F.normalize(vectors, dim=-1)
            if out is None:
                out = torch.zeros(len(ids), vectors.size(-1))
            out[idx] = vectors
        return out if out is not None else torch.zeros(0, self.model.cfg.d_model)

    def search(self, query: str, corpus: list[str], k: int = 5, pooling: str | None = None,
               corpus_vectors: torch.Tensor | None = None) -> list[tuple[float, int]]:
        """The ``k`` corpus entries most similar to ``query``: (cosine similarity, index), best first."""
        docs = corpus_vectors if corpus_vectors is not None else self.embed(corpus, pooling)
        q = self.embed([query], pooling)  # (1, d)
        sims = F.cosine_similarity(q, docs, dim=-1)  # (N,)
        top = sims.topk(min(k, sims.numel()))
        return [(float(s), int(i)) for s, i in zip(top.values, top.indices)]


@dataclass
class ClassifierReport:
    """A classifier's results on labelled data (class ids in the order of ``labels``)."""

    labels: list[str]
    golds: list[int]
    preds: list[int]

    @property
    def matrix(self) -> list[list[int]]:
        return confusion_matrix(self.golds, self.preds, len(self.labels))

    @property
    def accuracy(self) -> float:
        return accuracy(self.golds, self.preds)

    @property
    def macro_f1(self) -> float:
        return macro_f1(self.matrix)

    def text(self, name: str) -> str:
        """The report as ``qkv evaluate --test`` prints it."""
        per_class = ", ".join(f"{lab} {f:.4f}" for lab, f in zip(self.labels, f1_per_class(self.matrix)))
        return (f"{name}: {len(self.golds)} examples\naccuracy {self.accuracy:.4f}\n"
                f"macro-F1 {self.macro_f1:.4f}  (per class: {per_class})\n"
                f"confusion matrix (rows: true label, columns: predicted):\n"
                + format_confusion(self.matrix, self.labels))


def write_vectors(vectors: torch.Tensor, path: str) -> None:
    """An ``(N, d)`` array to ``path``, all or nothing: ``.npy`` (NumPy) or ``.tsv`` (one vector a line)."""
    import numpy as np

    from qkv.files import atomic_output

    suffix = Path(path).suffix
    if suffix not in (".npy", ".tsv"):
        raise QkvError(f"--output {path}: choose a .npy (NumPy array) or .tsv (one vector a line) file")
    array = vectors.numpy()
    with atomic_output(path, binary=suffix == ".npy") as fh:
        if suffix == ".npy":
            np.save(fh, array)
        else:
            fh.write("".join("\t".join(f"{v:.6g}" for v in row) + "\n" for row in array))

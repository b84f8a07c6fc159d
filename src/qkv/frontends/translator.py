"""The translation front-end: what ``qkv.load`` returns for a translate or prefix_lm checkpoint.

    >>> import qkv
    >>> model = qkv.load("runs/default/best")
    >>> model.translate(["three hundred twenty-one"])
    ['dreihunderteinundzwanzig']

Sentences are tokenized, sorted by length and decoded in batches (greedy or beam search through
the model's incremental ``start``/``step`` interface, :func:`qkv.decoding.batch.decode_sentences`),
then detokenized and returned in input order.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import torch

from qkv.config import BOS, DecodeConfig, TrainConfig
from qkv.data.batching import collate
from qkv.data.tokenizer import TokenizerPair
from qkv.decoding.batch import decode_sentences
from qkv.decoding.beam_search import Hypothesis
from qkv.decoding.greedy import banned_ids, max_output_len
from qkv.decoding.forced import forced_logprobs
from qkv.errors import ConfigError
from qkv.frontends.base import Frontend, TruncationHandler


class Translator(Frontend):
    """A trained model with its tokenizers and decoding settings: translation and prefix-LM checkpoints."""

    name = "translator"

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, decode_cfg: DecodeConfig | None = None,
                 train_cfg: TrainConfig | None = None):
        super().__init__(model, tokenizers, train_cfg)
        self.decode_cfg = (decode_cfg or DecodeConfig()).validate()
        self.decoder: torch.nn.Module | None = None  # the compiled step (compile_decoding), else the model's own

    def compile_decoding(self) -> "Translator":
        """Search with the decoding step compiled by ``torch.compile``, static shapes
        (:class:`qkv.decoding.compiled.CompiledDecoder`): Transformer encoder-decoders only. The
        outputs are the eager step's; the first batch of each shape compiles. On a CPU it warns,
        once a process (:func:`warn_cpu_compile`): it measured slower there. Returns self."""
        from qkv.decoding.compiled import CompiledDecoder

        if next(self.model.parameters()).device.type == "cpu":
            warn_cpu_compile()
        self.decoder = CompiledDecoder(self.model)
        return self

    @classmethod
    def from_checkpoint(cls, model, tokenizers, config, decode_cfg, train_cfg) -> "Translator":
        return cls(model, tokenizers, decode_cfg, train_cfg)

    def translate(self, sentences: list[str], **overrides) -> list[str]:
        """Translate each sentence; ``overrides`` are :class:`DecodeConfig` fields (e.g. ``beam_size=1``)."""
        return [nbest[0] for nbest in self.translate_nbest(sentences, **overrides)]

    @torch.inference_mode()
    def translate_nbest(self, sentences: list[str], **overrides) -> list[list[str]]:
        """The ``nbest`` best translations of each sentence, best first (greedy search leaves out the
        scores it would compute for :meth:`translate_scored`)."""
        hyps = self.hypotheses(sentences, scores=False, **overrides)
        texts = iter(self.tokenizers.tgt.decode([h.tokens for nbest in hyps for h in nbest]))
        return [[next(texts) for _ in nbest] for nbest in hyps]

    @torch.inference_mode()
    def translate_scored(self, sentences: list[str], on_truncate: TruncationHandler | None = None,
                         target_prefix: str | None = None, *, scores: bool = True,
                         **overrides) -> list[list[tuple[str, float]]]:
        """``(translation, score)`` pairs per sentence; the score is the (length-normalised) log-probability.

        A sentence longer than the model reads (learned positions end at ``max_positions``) is
        translated from its head: ``on_truncate(indices, kept)`` hears which sentences (0-based)
        were cut to how many tokens; without it a warning says so. Outputs never run past what the
        decoder's positions can index either (:func:`qkv.decoding.max_output_len`).
        ``target_prefix``: every translation starts with it (see :meth:`hypotheses`); ``scores=False``:
        greedy search leaves the scores out (NaN), for callers that print the texts only.
        """
        hyps = self.hypotheses(sentences, on_truncate, target_prefix, scores=scores, **overrides)
        texts = iter(self.tokenizers.tgt.decode([h.tokens for nbest in hyps for h in nbest]))  # one call
        return [[(next(texts), h.score) for h in nbest] for nbest in hyps]

    def hypotheses(self, sentences: list[str], on_truncate: TruncationHandler | None = None,
                   target_prefix: str | None = None, *, scores: bool = True, **overrides) -> list[list[Hypothesis]]:
        """The ``nbest`` hypotheses (token ids, score, logprob) of each sentence, best first.

        ``target_prefix``: each output starts with these target pieces, forced; the search goes on
        from there, and ``score``/``logprob`` cover the tokens after the prefix. ``scores=False``:
        greedy search does not compute them (``score`` and ``logprob`` are NaN), for callers that
        want the tokens only."""
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        cfg = replace(self.decode_cfg, **overrides).validate() if overrides else self.decode_cfg
        self.check_beam(cfg.beam_size)
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sentences)), on_truncate)
        banned = banned_ids(self.tokenizers.tgt)
        model = self.model if self.decoder is None else self.decoder
        if not target_prefix:
            return decode_sentences(model, src_ids, cfg, banned, scores=scores)
        prefix = self.tokenizers.tgt.encode([target_prefix])[0]
        hyps = decode_sentences(Prefixed(model, prefix, cfg), src_ids, cfg, banned, scores=scores)
        return [[Hypothesis(prefix + h.tokens, h.score, h.logprob) for h in nbest] for nbest in hyps]

    def translate_rich(self, sentences: list[str], on_truncate: TruncationHandler | None = None,
                       target_prefix: str | None = None, alignments: bool = True, attention: bool = False,
                       **overrides) -> list[list[dict]]:
        """Per sentence, its hypotheses as dicts: ``text``, ``score``, ``logprob``, ``tokens`` (target
        pieces), ``token_logprobs`` (one per piece and EOS, by forced decoding) and ``alignment``:
        each target piece j aligned to the source piece i its last decoder layer attends to most
        (cross-attention averaged over heads), in Pharaoh ``i-j`` form (None for models without
        cross-attention; left out with ``alignments=False``). ``attention=True`` adds ``attention``:
        the cross-attention weights of every layer and head (:meth:`cross_attention`, as lists)."""
        hyps = self.hypotheses(sentences, on_truncate, target_prefix, **overrides)
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sentences)))
        flat = [(i, h) for i, nbest in enumerate(hyps) for h in nbest]
        logprobs = forced_logprobs(self.model, [src_ids[i] for i, _ in flat], [h.tokens for _, h in flat])
        texts = self.tokenizers.tgt.decode([h.tokens for _, h in flat])
        out: list[list[dict]] = [[] for _ in sentences]
        for (i, h), text, lp in zip(flat, texts, logprobs):
            rich = {"text": text, "score": h.score, "logprob": h.logprob,
                    "tokens": [self.tokenizers.tgt.id_to_piece(t) for t in h.tokens], "token_logprobs": lp}
            weights = self.cross_attention(src_ids[i], h.tokens) if alignments or attention else None
            if alignments:
                rich["alignment"] = None if weights is None or not h.tokens else pharaoh(weights, len(src_ids[i]))
            if attention:
                rich["attention"] = None if weights is None else weights.tolist()
            out[i].append(rich)
        return out

    @torch.inference_mode()
    def cross_attention(self, src: list[int], tgt: list[int]) -> torch.Tensor | None:
        """The cross-attention weights of every decoder layer and head for target pieces ``tgt``
        given source pieces ``src`` (ids, without BOS/EOS): ``(layers, heads, len(tgt) + 1, len(src) + 1)``,
        row j the query that produces target piece j (the last row produces EOS), column i source
        piece i (the last column: the source's EOS). A recurrent encoder-decoder's alignment a_t(s)
        is one layer with one head. None for models without cross-attention."""
        if self.task_declaration.stack != "encoder-decoder" or not getattr(self.model, "has_attention", True):
            return None
        batch = collate([src], [tgt]).to(self.device)
        with self.evaluating():
            maps = self.model.attention_maps(batch.src, batch.tgt_in)
        if isinstance(maps, torch.Tensor):  # a recurrent model: (B, T, S)
            return maps[0][None, None].float().cpu()  # (1, 1, T, S)
        return torch.stack([layer[0] for layer in maps.cross]).float().cpu()  # (L, h, T, S)

    def alignment(self, src: list[int], tgt: list[int]) -> str | None:
        """``i-j`` pairs: target piece j and the source piece i that the last decoder layer's
        cross-attention (mean over heads) weighs most when producing it; None without cross-attention."""
        weights = self.cross_attention(src, tgt) if tgt else None
        return None if weights is None else pharaoh(weights, len(src))

    def translate_lines(self, lines: list[str], on_truncate: TruncationHandler | None = None, chunk: int = 0,
                        rich: bool = False, scores: bool = True, **overrides) -> Iterator[list]:
        """The ``nbest`` ``(translation, score)`` pairs of each line (with ``rich``: the dicts of
        :meth:`translate_rich`), in order, decoded ``chunk`` lines at a time (default: 8 batches),
        so that output streams on long files. An empty line gets ``nbest`` empty translations (rich:
        none); ``on_truncate(indices, kept)`` hears indices into ``lines``. ``overrides`` may hold
        ``target_prefix`` and :class:`DecodeConfig` fields; ``scores=False``: see :meth:`translate_scored`."""
        nbest = overrides.get("nbest", self.decode_cfg.nbest)
        chunk = chunk or overrides.get("batch_size", self.decode_cfg.batch_size) * 8
        translate = self.translate_rich if rich else functools.partial(self.translate_scored, scores=scores)
        for start in range(0, len(lines), chunk):
            part = lines[start : start + chunk]
            keep = [i for i, line in enumerate(part) if line.strip()]
            warn = None if on_truncate is None else \
                (lambda idx, kept, keep=keep, start=start: on_truncate([start + keep[i] for i in idx], kept))
            done = dict(zip(keep, translate([part[i] for i in keep], on_truncate=warn, **overrides) if keep else []))
            for i in range(len(part)):
                yield done.get(i, [] if rich else [("", 0.0)] * nbest)

    def translate_stream(self, chunks: Iterable[Sequence[str]], on_truncate: TruncationHandler | None = None,
                         rich: bool = False, scores: bool = True, **overrides) -> Iterator[list]:
        """:meth:`translate_lines` over a stream of lists of lines (a big file read a chunk at a time,
        e.g. :func:`qkv.data.corpus.input_chunks`), in order; ``on_truncate`` hears indices counted
        from the first line of the stream."""
        done = 0
        for lines in chunks:
            warn = None if on_truncate is None else \
                (lambda idx, kept, base=done: on_truncate([base + i for i in idx], kept))
            yield from self.translate_lines(list(lines), warn, rich=rich, scores=scores, **overrides)
            done += len(lines)

    def score(self, sources: list[str], targets: list[str | Sequence[str]],
              on_truncate: TruncationHandler | None = None) -> list[list[float]]:
        """Forced decoding: the log-probability of each target token given its source and the
        target's previous tokens, EOS last (:func:`qkv.decoding.forced.forced_logprobs`); their sum
        is log p(target | source).

        A target is a text, tokenized by the target tokenizer, or a list of target pieces, scored
        as given (the ``tokens`` of :meth:`translate_rich`, of ``--output-format jsonl``). Scoring a
        beam-search output by its own pieces gives its ``logprob`` exactly; its text may score
        otherwise, where the search chose pieces that are not the tokenizer's segmentation of the text."""
        if isinstance(sources, str) or isinstance(targets, str):
            raise TypeError("score() takes lists of sentences, not single strings")
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sources)), on_truncate)
        tgt = self.tokenizers.tgt
        texts = iter(tgt.encode([t for t in targets if isinstance(t, str)]))
        tgt_ids = [next(texts) if isinstance(t, str) else tgt.piece_ids(t, f"target {i + 1}")
                   for i, t in enumerate(targets)]
        return self.forced(src_ids, tgt_ids)

    def forced(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[list[float]]:
        """Per pair of id lists, the log-probability of each target token and EOS (teacher-forced)."""
        return forced_logprobs(self.model, src_ids, tgt_ids, self.decode_cfg.batch_size)

    def check_beam(self, beam_size: int) -> None:
        """A beam wider than the target vocabulary has nothing to fill it with: refused by name."""
        vocab = self.tokenizers.tgt.vocab_size
        if beam_size > vocab:
            raise ConfigError(f"invalid config field 'beam_size': {beam_size} is larger than the model's target "
                              f"vocabulary ({vocab} tokens); choose at most {vocab}")

    def fit_sources(self, src_ids: list[list[int]], on_truncate: TruncationHandler | None = None) -> list[list[int]]:
        """Token lists cut to what the model reads (its ``max_source_len``, EOS included)."""
        limit = self.model.max_source_len()
        if limit is None:
            return src_ids
        kept = limit - 1  # collate appends EOS
        cut = [i for i, ids in enumerate(src_ids) if len(ids) > kept]
        if cut:
            if on_truncate is None:
                warnings.warn(f"{len(cut)} of {len(src_ids)} sentences are longer than the model reads "
                              f"({kept} tokens, max_positions={limit}): translated from their first {kept} tokens",
                              stacklevel=3)
            else:
                on_truncate(cut, kept)
        return [ids[:kept] for ids in src_ids]


def pharaoh(weights: torch.Tensor, src_len: int) -> str:
    """``i-j`` pairs from :meth:`Translator.cross_attention` weights ``(L, h, T, S)``: each target
    piece j and the source piece i the last layer (mean over heads) weighs most."""
    best = weights[-1].mean(dim=0)[:-1, :src_len].argmax(dim=-1).tolist()  # (T - 1,): the EOS row left out
    return " ".join(f"{i}-{j}" for j, i in enumerate(best))


_cpu_compile_warned = False


def warn_cpu_compile() -> None:
    """Warn, the first time in a process, that compiled decoding on a CPU measured slower than the
    eager step (docs/results.md, "Compiled decoding"): it pays on a GPU."""
    global _cpu_compile_warned
    if not _cpu_compile_warned:
        _cpu_compile_warned = True
        warnings.warn("--compile on a CPU: compiled decoding measured slower than the eager step on the CPUs "
                      "tried (docs/results.md, Compiled decoding) and compiles for tens of seconds first; it "
                      "pays on a GPU (--device cuda); leave --compile out on a CPU", stacklevel=3)


class Prefixed(torch.nn.Module):
    """A model whose every output starts with ``prefix`` (target ids): :meth:`start` feeds BOS and
    the prefix but its last token, and the first :meth:`step` (given BOS by the search) feeds that
    last token, so greedy and beam search continue after the prefix. The output budget of ``cfg``
    (``a·|x| + b`` tokens, and what the model's positions allow) counts the prefix."""

    def __init__(self, model: torch.nn.Module, prefix: list[int], cfg: DecodeConfig):
        super().__init__()
        self.model, self.prefix, self.cfg = model, list(prefix), cfg
        self._first = False

    def max_source_len(self):
        return self.model.max_source_len()

    def max_steps(self, src_lengths):
        """The model's own step limit and the whole output's budget (plus its EOS step), less the prefix."""
        whole = max_output_len(src_lengths, self.cfg.max_len_a, self.cfg.max_len_b) + 1
        steps = self.model.max_steps(src_lengths)
        if steps is not None:
            whole = torch.minimum(whole, torch.as_tensor(steps))
        return (whole - len(self.prefix)).clamp(min=1)

    def start(self, src: torch.Tensor):
        state = self.model.start(src)
        for token in [BOS, *self.prefix[:-1]]:
            _, state = self.model.step(torch.full((src.size(0),), token, dtype=torch.long, device=src.device), state)
        self._first = True
        return state

    def step(self, tokens: torch.Tensor, state):
        if self._first:  # the search's BOS: the prefix's last token instead
            tokens, self._first = torch.full_like(tokens, self.prefix[-1]), False
        return self.model.step(tokens, state)


__all__ = ["Translator", "Prefixed"]

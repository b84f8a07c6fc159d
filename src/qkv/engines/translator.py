"""CTranslate2 as a decoding engine behind the translation front-end (``--engine ctranslate2``).

    >>> import qkv
    >>> model = qkv.load("runs/ende/best", engine="ctranslate2")
    >>> model.translate(["a man rides a bike"], beam_size=1)

The checkpoint is converted once (:func:`qkv.export.ct2.write`, the export's converter, checked
on its probe sequences) into a cache: ``CHECKPOINT/ct2-KEY/``, ``KEY`` made from the checksums in
the checkpoint's ``manifest.json`` (and the CTranslate2 version), so a changed checkpoint gets a
new conversion and a stale one is never read. A conversion is written into a temporary directory
and renamed into place with its own checksums (``qkv_cache.json``): a crash leaves no half cache,
and a cache whose files no longer match is converted again. Where the checkpoint's directory
cannot be written, or a file or link other than a directory is where the cache would go, the cache
goes to ``$QKV_CACHE_DIR`` (default ``~/.cache/qkv``) ``/ct2/``.

:class:`CT2Translator` is a :class:`~qkv.frontends.Translator` whose searches run in
``ctranslate2.Translator.translate_batch`` (one call for the sentences of a call, and one per
distinct length limit that changed a search: :meth:`CT2Translator.search`) and whose scores come
from its searches and its ``score_batch``, with qkv's decoding settings mapped as the export documents them: beam size,
n-best, ``--length-norm length`` with ``--early-stopping`` (CTranslate2's only beam rule), the
per-sentence length limits, ``min_len``, the target prefix; alignments from its attention (the
last layer's mean over heads, as qkv's). What it cannot compute exactly is refused by name:
``--length-norm gnmt`` or a beam search without ``--early-stopping``, the attention of every layer
and head, models other than translation Transformers; ``qkv translate`` checks the settings it will
decode with (:func:`check_options`) before it converts.

The translator runs in a supervised worker process (:mod:`qkv.engines.worker`): one that ends is
replaced, a call it does not answer within ``timeout`` seconds kills and replaces it, and either
call fails with :class:`~qkv.engines.worker.WorkerError` (``qkv serve``: 503 with Retry-After).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from qkv.checkpoint import listed_files, read_config
from qkv.config import DecodeConfig
from qkv.data.tokenizer import TokenizerPair
from qkv.decoding.beam_search import Hypothesis, _norm
from qkv.decoding.greedy import max_output_len
from qkv.errors import CheckpointError, QkvError
from qkv.engines.cache import Log, converted, require_ctranslate2, stderr  # noqa: F401 (the engine's API)
from qkv.engines.worker import TIMEOUT_S, TranslatorProcess, WorkerError
from qkv.engines.options import check_options, check_settings
from qkv.frontends.translator import Prefixed, Translator, pharaoh
from qkv.models import build_model

ENGINES = ("qkv", "ctranslate2")
# --- the front-end -------------------------------------------------------------------------------------

class CT2Translator(Translator):
    """A :class:`~qkv.frontends.Translator` that decodes and scores with ``ctranslate2.Translator``.

    ``model``: the checkpoint's network built on the meta device (its configuration and length
    rules, no weights): every computation runs in CTranslate2."""

    engine = "ctranslate2"

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, decode_cfg: DecodeConfig, train_cfg,
                 translator, directory: Path):
        super().__init__(model, tokenizers, decode_cfg, train_cfg)
        self.ct2, self.directory = translator, directory
        from qkv.export.ct2 import pieces  # the conversion's vocabulary (its strings are CTranslate2's tokens)

        tgt = tokenizers.tgt
        self.piece_table = {side: pieces(t) for side, t in (("src", tokenizers.src), ("tgt", tgt))}
        self.tgt_ids = {p: i for i, p in enumerate(self.piece_table["tgt"])}

    # --- what CTranslate2 cannot do as qkv does: refused by name ------------------------------------------

    def check_settings(self, cfg: DecodeConfig, prefixed: bool = False) -> None:
        check_settings(cfg, prefixed)

    def worker_status(self) -> dict:
        """The worker's state (:meth:`~qkv.engines.worker.TranslatorProcess.status`): ``qkv serve``'s /health."""
        return self.ct2.status()

    def cross_attention(self, src: list[int], tgt: list[int]):
        raise QkvError("the attention weights of every layer and head come from --engine qkv; --engine ctranslate2 "
                       "gives alignments (its last layer's mean over heads)")

    def alignment(self, src: list[int], tgt: list[int]) -> str | None:
        """:meth:`Translator.alignment` from CTranslate2's attention (its last layer's mean over heads)."""
        return aligned(self.forced_attention([src], [tgt])[0], len(src)) if tgt else None

    # --- decoding --------------------------------------------------------------------------------------

    def budgets(self, src_ids: list[list[int]], prefix: list[int], cfg: DecodeConfig) -> list[int]:
        """Tokens each output may hold, the prefix included: what :func:`qkv.decoding.batch.decode_sentences`
        gives qkv's search (``max_len_a · |x| + max_len_b``, where learned positions end)."""
        lengths = torch.tensor([len(ids) + 1 for ids in src_ids])  # with EOS, as collate writes them
        model = Prefixed(self.model, prefix, cfg) if prefix else self.model
        steps = model.max_steps(lengths)
        limit = None if steps is None else torch.as_tensor(steps) - 1
        return [len(prefix) + int(n) for n in max_output_len(lengths, cfg.max_len_a, cfg.max_len_b, limit)]

    def search(self, src_ids: list[list[int]], prefix: list[int], cfg: DecodeConfig,
               scores: bool = True) -> list[list[Hypothesis]]:
        """Per sentence, the ``nbest`` hypotheses best first, with qkv's scores.

        One ``translate_batch`` call searches every sentence with the longest limit of the call
        (CTranslate2 has one ``max_decoding_length`` a call). qkv's limit is per sentence, and where
        it matters the sentence needs more (:meth:`limited`): a greedy output is cut at its
        sentence's limit; beam-search sentences whose hypotheses reach their own limit, below the
        call's, are searched again with it, one call per distinct limit; the hypotheses a limit ended
        (CTranslate2 ends them without EOS) get EOS's log-probability as qkv's search gives it (forced
        there), all in one ``score_batch`` call, and are ranked again."""
        budgets = self.budgets(src_ids, prefix, cfg)
        greedy = cfg.beam_size == 1 and cfg.nbest == 1
        sources = [self.pieces(ids) for ids in src_ids]
        target = [self.pieces(prefix, "tgt")] * len(src_ids) if prefix else None
        longest = max(budgets, default=1)
        results = self.decode_batch(sources, target, longest, cfg, scores)
        limit = [longest] * len(src_ids)  # the max_decoding_length each sentence was searched with
        for budget, rows in ({} if greedy else self.limited(results, budgets)).items():
            redone = self.decode_batch([sources[i] for i in rows], target and target[: len(rows)], budget, cfg)
            for i, r in zip(rows, redone):
                results[i], limit[i] = r, budget
        hyps = [[[self.tgt_ids[p] for p in h] for h in r.hypotheses] for r in results]
        if greedy and not scores:
            return [[Hypothesis(hyps[i][0][: budgets[i]], math.nan, math.nan)] for i in range(len(hyps))]
        # the hypotheses a limit ended without EOS: CTranslate2 stopped them at max_decoding_length, or
        # (greedy) they ran past their sentence's limit and are cut there
        ended = [(i, k) for i, nbest in enumerate(hyps) for k, tokens in enumerate(nbest)
                 if len(tokens) >= limit[i] or len(tokens) > budgets[i]]
        logprobs = self.forced([src_ids[i] for i, _ in ended], [hyps[i][k][: budgets[i]] for i, k in ended])
        forced: list[dict[int, list[float]]] = [{} for _ in hyps]
        for (i, k), lp in zip(ended, logprobs):
            forced[i][k] = lp
        if greedy:
            return [[self.greedy_hypothesis(hyps[i][0][: budgets[i]], results[i].scores[0], forced[i].get(0), prefix,
                                            cfg)] for i in range(len(hyps))]
        return [self.ranked(hyps[i], results[i].scores, forced[i], prefix, cfg) for i in range(len(hyps))]

    def decode_batch(self, sources: list[list[str]], target, max_length: int, cfg: DecodeConfig, scores: bool = True):
        """One ``translate_batch`` call with qkv's settings (:meth:`search`) and ``max_length`` for
        every sentence. The beam keeps ``beam_size`` hypotheses a sentence (those a limit ended may
        be ranked again); greedy scores are raw sums of log-probabilities (length penalty 0), left
        out with ``scores=False``."""
        greedy = cfg.beam_size == 1 and cfg.nbest == 1
        # qkv's min_len counts the tokens after the prefix; CTranslate2's min_decoding_length the whole output
        prefix = len(target[0]) if target else 0
        return self.ct2.translate_batch(sources, target, beam_size=cfg.beam_size,
                                        num_hypotheses=1 if greedy else cfg.beam_size,
                                        length_penalty=0.0 if greedy else cfg.length_penalty,
                                        min_decoding_length=min(prefix + cfg.min_len, max_length),  # max wins
                                        max_decoding_length=max_length,
                                        return_scores=scores or not greedy, max_input_length=0,
                                        max_batch_size=cfg.batch_size)

    @staticmethod
    def limited(results, budgets: list[int]) -> dict[int, list[int]]:
        """The beam-search sentences whose hypotheses reached their own limit, below the call's
        (that limit would have changed their search), by limit: ``{limit: [sentence, ...]}``."""
        again: dict[int, list[int]] = {}
        longest = max(budgets, default=1)
        for i, r in enumerate(results):
            if budgets[i] < longest and max(map(len, r.hypotheses)) >= budgets[i]:
                again.setdefault(budgets[i], []).append(i)
        return again

    @staticmethod
    def greedy_hypothesis(tokens: list[int], score: float, forced: list[float] | None, prefix: list[int],
                          cfg: DecodeConfig) -> Hypothesis:
        """A greedy output (cut at its sentence's limit) with qkv's ``logprob``, the tokens after the
        prefix and EOS: CTranslate2's sum where its EOS ended it, else ``forced`` (its scoring with EOS
        at the limit); and the ``score`` a beam of one gives it."""
        logprob = score if forced is None else sum(forced[len(prefix):])
        return Hypothesis(tokens, logprob / _norm(len(tokens) - len(prefix) + 1, cfg.length_penalty, cfg.length_norm),
                          logprob)

    @staticmethod
    def ranked(hyps: list[list[int]], scores: list[float], forced: dict[int, list[float]], prefix: list[int],
               cfg: DecodeConfig) -> list[Hypothesis]:
        """One sentence's beam-search hypotheses as qkv's search gives them: ``score = log P / |Y|^alpha``,
        ``|Y|`` the tokens after the prefix and EOS (a prefix is refused unless alpha = 0); those that a
        limit ended (``forced``: their log-probabilities with EOS last, by hypothesis) get EOS's
        log-probability and are ranked again."""
        alpha, n = cfg.length_penalty, lambda tokens: len(tokens) - len(prefix)
        if not forced:  # CTranslate2's order (best first, by the same scores) is qkv's: its first nbest
            hyps, scores = hyps[: cfg.nbest], scores[: cfg.nbest]
        out = []
        for k, (tokens, score) in enumerate(zip(hyps, scores)):
            if k in forced:
                logprob = score * n(tokens) ** alpha + forced[k][-1]
            else:
                logprob = score * (n(tokens) + 1) ** alpha
            out.append(Hypothesis(tokens, logprob / (n(tokens) + 1) ** alpha, logprob))
        return sorted(out, key=lambda h: -h.score)[: cfg.nbest]

    def pieces(self, ids: list[int], side: str = "src") -> list[str]:
        table = self.piece_table[side]
        return [table[i] for i in ids]

    def forced_attention(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[np.ndarray]:
        """Per pair, the cross-attention ``(len(tgt), len(src) + 1)`` of the last decoder layer (mean
        over heads) when the decoder is fed ``tgt``: the target given as the prefix of a one-step search."""
        if not src_ids:
            return []
        results = self.ct2.translate_batch([self.pieces(s) for s in src_ids], [self.pieces(t, "tgt") for t in tgt_ids],
                                           beam_size=1, max_decoding_length=max(map(len, tgt_ids)) + 1,
                                           min_decoding_length=0, return_attention=True, max_input_length=0,
                                           max_batch_size=self.decode_cfg.batch_size)
        return [np.asarray(r.attention[0][: len(t)], dtype=np.float32).reshape(len(t), -1)
                for r, t in zip(results, tgt_ids)]

    def _decode(self, sentences, on_truncate, target_prefix, overrides: dict, scores: bool = True):
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        cfg = replace(self.decode_cfg, **overrides).validate() if overrides else self.decode_cfg
        self.check_beam(cfg.beam_size)
        self.check_settings(cfg, bool(target_prefix))
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sentences)), on_truncate)
        prefix = self.tokenizers.tgt.encode([target_prefix])[0] if target_prefix else []
        return src_ids, self.search(src_ids, prefix, cfg, scores) if src_ids else []

    def hypotheses(self, sentences, on_truncate=None, target_prefix=None, *, scores: bool = True,
                   **overrides) -> list[list[Hypothesis]]:
        return self._decode(sentences, on_truncate, target_prefix, overrides, scores)[1]

    def translate_rich(self, sentences, on_truncate=None, target_prefix=None, alignments: bool = True,
                       attention: bool = False, **overrides) -> list[list[dict]]:
        """:meth:`Translator.translate_rich` computed by CTranslate2: ``token_logprobs`` by its
        ``score_batch``, ``alignment`` from its attention (the last layer's mean over heads).
        ``attention=True`` (every layer and head) is refused: CTranslate2 does not return them."""
        if attention:
            self.cross_attention([], [])
        src_ids, hyps = self._decode(sentences, on_truncate, target_prefix, overrides)
        flat = [(i, h) for i, nbest in enumerate(hyps) for h in nbest]
        pairs = [src_ids[i] for i, _ in flat], [h.tokens for _, h in flat]
        logprobs = self.forced(*pairs)
        wanted = [k for k, (_, h) in enumerate(flat) if h.tokens] if alignments else []
        weights = dict(zip(wanted, self.forced_attention([pairs[0][k] for k in wanted], [pairs[1][k] for k in wanted])))
        texts = self.tokenizers.tgt.decode(pairs[1])
        out: list[list[dict]] = [[] for _ in sentences]
        for k, ((i, h), text, lp) in enumerate(zip(flat, texts, logprobs)):
            rich = {"text": text, "score": h.score, "logprob": h.logprob,
                    "tokens": self.pieces(h.tokens, "tgt"), "token_logprobs": lp}
            if alignments:
                rich["alignment"] = aligned(weights[k], len(src_ids[i])) if k in weights else None
            out[i].append(rich)
        return out

    def forced(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[list[float]]:
        """Per pair, the log-probability of each target token and EOS: ``score_batch`` (what
        :meth:`Translator.score` returns; CTranslate2's log-probabilities leave out the special
        tokens neither decoder emits, a difference of log(1 - p(special)) per token)."""
        if not src_ids:
            return []
        results = self.ct2.score_batch([self.pieces(s) for s in src_ids], [self.pieces(t, "tgt") for t in tgt_ids],
                                       max_batch_size=self.decode_cfg.batch_size, max_input_length=0)
        return [[float(v) for v in r.log_probs] for r in results]


def aligned(rows: np.ndarray, src_len: int) -> str:
    """:func:`~qkv.frontends.translator.pharaoh` of CTranslate2's attention rows ``(T, S)``: one layer, one
    head, and a row for EOS (which pharaoh leaves out)."""
    return pharaoh(torch.from_numpy(np.concatenate([rows, rows[-1:]]))[None, None], src_len)


# --- loading ---------------------------------------------------------------------------------------------

def ct2_device(device: str) -> tuple[str, int]:
    """qkv's ``--device`` (cpu, cuda, cuda:N, auto) as CTranslate2's ``(device, device_index)``."""
    ctranslate2 = require_ctranslate2()
    name, _, index = str(device).partition(":")
    if name == "auto":
        return ("cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"), 0
    if name not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise QkvError(f"--device {device!r}: choose auto, cpu, cuda or cuda:N")
    if name == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        raise QkvError(f"--device {device}: CTranslate2 sees no CUDA GPU here (use --device cpu)")
    return name, int(index or 0)


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise QkvError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")


def check_timeout(timeout) -> float:
    """``--engine-timeout``: a positive, finite number of seconds (None: the default)."""
    if timeout is None:
        return TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise QkvError(f"--engine-timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def saved_settings(path: Path):
    """The checkpoint's model and decoding configurations (checked), refused by name where
    CTranslate2 does not decode the model."""
    model_cfg, decode_cfg = (read_config(path, s) for s in ("model", "decode"))
    try:
        model_cfg, decode_cfg = model_cfg.validate(), decode_cfg.validate()
    except QkvError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    if (model_cfg.task, model_cfg.arch) != ("translate", "transformer"):
        raise QkvError(f"{path} is a {model_cfg.task!r} model with arch {model_cfg.arch!r}: --engine ctranslate2 "
                       "decodes translation Transformers (task translate); use --engine qkv")
    return model_cfg, decode_cfg


def load(path: str | Path, device: str = "cpu", quantize: str | None = None, threads: int = 0,
         log: Log = stderr, timeout: float | None = None) -> CT2Translator:
    """The translation checkpoint ``path`` as a :class:`CT2Translator`: converted once into the cache
    (:func:`converted`), run by ``ctranslate2.Translator`` on ``device`` with ``threads`` intra-op
    threads (0: CTranslate2's default); ``quantize="int8"``: compute_type int8. The translator lives
    in a worker process of its own (:class:`~qkv.engines.worker.TranslatorProcess`), so that
    translators loaded side by side (``qkv serve a=RUN b=RUN``) never slow each other; a worker that
    ends is replaced, and a call it does not answer within ``timeout`` seconds (default
    :data:`~qkv.engines.worker.TIMEOUT_S`) kills and replaces it (either call fails with
    :class:`~qkv.engines.worker.WorkerError`; the next is answered)."""
    from qkv.frontends.quantize import QUANTIZE_CHOICES

    require_ctranslate2()
    if quantize not in QUANTIZE_CHOICES:
        raise QkvError(f"quantize must be None or 'int8', got {quantize!r}")
    timeout = check_timeout(timeout)
    path = Path(path)
    model_cfg, decode_cfg = saved_settings(path)
    train_cfg = read_config(path, "train")
    name, index = ct2_device(device)
    directory = converted(path, log)
    tokenizers = TokenizerPair.load(path, listed_files(path))
    with torch.device("meta"):  # the configuration and length rules; the weights live in CTranslate2
        model = build_model(model_cfg)
    translator = TranslatorProcess(str(path), timeout=timeout, model_path=str(directory), device=name,
                                   device_index=index, compute_type="int8" if quantize else "default",
                                   intra_threads=threads)
    return CT2Translator(model.eval(), tokenizers, decode_cfg, train_cfg, translator, directory)


__all__ = ["ENGINES", "CT2Translator", "WorkerError", "load", "converted",
           "check_engine", "check_options", "check_settings", "check_timeout"]

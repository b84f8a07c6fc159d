"""The models a server holds, and what each request does with them (no web framework here).

:class:`Served` wraps one front-end (what :func:`qkv.load` returns) with its name, its
:class:`~qkv.serve.batcher.Batcher` and the checks a request passes before it is queued. The
methods return JSON-ready dicts; a request the server refuses raises :class:`RequestError` with
its HTTP status.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

from qkv.errors import QkvError
from qkv.serve.batcher import Batcher, Busy
from qkv.serve.limits import Limits

# what a task offers (qkv.tasks.base.Task.offers) -> the endpoint that serves it
ENDPOINTS = {"translate": "/translate", "score": "/score", "classify": "/classify", "fill": "/fill",
             "embed": "/embed", "generate": "/generate"}


class RequestError(Exception):
    """A request the server refuses: ``status`` (4xx) and a message that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def model_name(path: str) -> tuple[str, Path]:
    """``NAME=PATH`` or ``PATH``: a run's checkpoint ``runs/ende/best`` is named ``ende``."""
    if "=" in path and not Path(path).exists():
        name, _, rest = path.partition("=")
        if name and rest:
            return name, Path(rest)
    p = Path(path)
    return (p.parent.name if p.name in ("best", "last") and p.parent.name else p.name) or "model", p


class Served:
    """One model as the server holds it: a front-end, a name, a batcher, and the request checks."""

    def __init__(self, name: str, frontend, limits: Limits, path: str = ""):
        self.name, self.frontend, self.limits, self.path = name, frontend, limits, path
        self.batcher = Batcher(self.run_batch, name, limits.batch_wait_ms, limits.max_batch_tokens, limits.max_queue)

    # --- what the model is ----------------------------------------------------------------------------

    @property
    def task(self) -> str:
        return self.frontend.task

    @property
    def endpoints(self) -> list[str]:
        return [path for offer, path in ENDPOINTS.items() if offer in self.frontend.offers]

    @property
    def has_cross_attention(self) -> bool:
        """Whether requests may ask for the attention weights of every layer and head (qkv's engine)."""
        decl = self.frontend.task_declaration
        return (decl.stack == "encoder-decoder" and getattr(self.frontend.model, "has_attention", True)
                and self.frontend.engine == "qkv")

    def describe(self) -> dict:
        """What ``GET /models`` tells of the model: its name, never where its checkpoint lies."""
        f, decl = self.frontend, self.frontend.task_declaration
        out = {"name": self.name, "task": self.task, "kind": decl.kind, "arch": f.model.cfg.arch,
               "engine": f.engine, "endpoints": self.endpoints,
               "parameters": sum(p.numel() for p in f.model.parameters())}
        if "translate" in f.offers:
            out.update(cross_attention=self.has_cross_attention, beam_size=f.decode_cfg.beam_size,
                       max_beam=min(self.limits.max_beam, f.tokenizers.tgt.vocab_size),
                       max_tokens=self.max_tokens())
        if "classify" in f.offers:
            out["labels"] = list(f.labels or [])
        if "embed" in f.offers:
            out["embedding"] = {"pooling": f.default_pooling, "normalized": bool(f.normalize),
                                "dimension": f.model.cfg.d_model}
        return out

    def max_tokens(self) -> int:
        """Tokens a text may have: the server's bound, and where the model's learned positions end."""
        limit = self.frontend.model.max_source_len() if hasattr(self.frontend.model, "max_source_len") else None
        if self.frontend.name == "encoder":
            limit = self.frontend.max_len + 1
        return self.limits.max_tokens if limit is None else min(self.limits.max_tokens, limit - 1)

    def require(self, offer: str) -> None:
        if offer not in self.frontend.offers:
            serves = ", ".join(self.endpoints) or "nothing"
            raise RequestError(422, f"model {self.name!r} is {self.frontend.task_declaration.kind} ({self.task}): "
                                    f"it serves {serves}, not {ENDPOINTS[offer]}")

    def health(self) -> dict:
        """The model's ``state`` for ``GET /health``: ``ready`` when its batcher runs and its engine can
        answer (a CTranslate2 worker: its own state, ``restarting``, ``down`` or ``failed``, with its
        ``restarts`` and last ``problem``), else not ``ready``."""
        running = self.batcher.task is not None and not self.batcher.task.done()
        out = {"state": "ready" if running else "stopped", "engine": self.frontend.engine}
        status = getattr(self.frontend, "worker_status", None)
        if running and status is not None:
            out.update({k: v for k, v in status().items() if k != "pid"})
        return out

    # --- request checks -------------------------------------------------------------------------------

    def check_texts(self, texts: list[str], what: str = "text", tokenizer=None, may_be_empty: bool = False) -> int:
        """Refuse too many texts, an empty or blank one (unless ``may_be_empty``: /score's targets), one
        too long or not valid Unicode; the token count of all of them."""
        lim = self.limits
        if len(texts) > lim.max_texts:
            raise RequestError(413, f"{len(texts)} {what}s in one request; this server takes at most {lim.max_texts}")
        tokenizer = tokenizer or self.frontend.tokenizers.src
        total = 0
        for i, text in enumerate(texts, 1):
            if not may_be_empty and not text.strip():
                raise RequestError(422, f"{what} {i} is empty: every {what} must hold more than spaces")
            if len(text) > lim.max_chars:
                raise RequestError(413, f"{what} {i} has {len(text)} characters; this server takes at most "
                                        f"{lim.max_chars} per {what}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(422, f"{what} {i} is not valid Unicode (it holds a lone surrogate)") from None
            n = len(tokenizer.encode([text])[0])
            if n > self.max_tokens():
                raise RequestError(413, f"{what} {i} is {n} tokens; this model takes at most {self.max_tokens()} "
                                        f"per {what}")
            total += n + 1
        return total

    def decode_settings(self, beam_size: int | None, n_best: int, prefixed: bool = False) -> tuple[int, int]:
        lim, cfg = self.limits, self.frontend.decode_cfg
        beam = cfg.beam_size if beam_size is None else beam_size
        if beam > lim.max_beam:
            raise RequestError(422, f"beam_size {beam} is more than this server allows ({lim.max_beam})")
        if n_best > lim.max_nbest:
            raise RequestError(422, f"n_best {n_best} is more than this server allows ({lim.max_nbest})")
        if n_best > beam:
            raise RequestError(422, f"n_best {n_best} is more than beam_size {beam}: a beam of {beam} "
                                    f"has at most {beam} hypotheses")
        try:
            dataclasses.replace(cfg, beam_size=beam, nbest=n_best).validate()
            self.frontend.check_beam(beam)
            if self.frontend.engine != "qkv":  # what CTranslate2 cannot decode as qkv does, refused by name
                self.frontend.check_settings(dataclasses.replace(cfg, beam_size=beam, nbest=n_best), prefixed)
        except QkvError as e:
            raise RequestError(422, str(e)) from None
        return beam, n_best

    # --- requests -------------------------------------------------------------------------------------

    async def submit(self, key: Hashable, items: list, tokens: int) -> list:
        """The batcher's results; a model failing on this request is a 500 for it alone."""
        try:
            return await self.batcher.submit(key, items, tokens)
        except (QkvError, RequestError, Busy):
            raise
        except Exception as e:  # noqa: BLE001
            raise RequestError(500, f"the model failed on this request: {type(e).__name__}: {e}") from None

    async def translate(self, texts: list[str], beam_size: int | None = None, n_best: int = 1,
                        target_prefix: str | None = None, alignments: bool = False, attention: bool = False) -> dict:
        self.require("translate")
        beam, n_best = self.decode_settings(beam_size, n_best, bool(target_prefix))
        tokens = self.check_texts(texts)
        if target_prefix is not None:
            self.check_texts([target_prefix], "target_prefix", self.frontend.tokenizers.tgt)
        if attention and self.frontend.engine != "qkv":
            raise RequestError(501, f"model {self.name!r} is decoded by {self.frontend.engine}, which gives alignments "
                                    "but not the attention weights of every layer and head: those need qkv serve "
                                    "--engine qkv")
        want_attention = bool(attention and self.has_cross_attention)
        if want_attention and len(texts) * n_best > self.limits.max_attention:
            raise RequestError(413, f"attention weights for {len(texts)} texts × n_best {n_best} hypotheses; this "
                                    f"server gives them for at most {self.limits.max_attention} per request")
        key = ("translate", beam, n_best, target_prefix or None, bool(alignments), want_attention)
        results = await self.submit(key, texts, tokens)
        src = self.frontend.tokenizers.src
        out = []
        for text, hyps in zip(texts, results):
            row = {"source": text, "hypotheses": hyps}
            if want_attention:
                row["source_tokens"] = [src.id_to_piece(t) for t in src.encode([text])[0]] + ["</s>"]
            out.append(row)
        return {"model": self.name, "beam_size": beam, "n_best": n_best, "results": out}

    async def score(self, pairs: list[tuple[str, str]]) -> dict:
        self.require("score")
        tokens = self.check_texts([s for s, _ in pairs], "source")
        self.check_texts([t for _, t in pairs], "target", self.frontend.tokenizers.tgt, may_be_empty=True)
        results = await self.submit(("score",), pairs, tokens)
        return {"model": self.name, "results": [
            {"source": s, "target": t, "logprob": sum(lp), "token_logprobs": lp,
             "tokens": [self.frontend.tokenizers.tgt.id_to_piece(x) for x in self.frontend.tokenizers.tgt.encode([t])[0]]
             + ["</s>"]}
            for (s, t), lp in zip(pairs, results)]}

    async def classify(self, texts: list[str]) -> dict:
        self.require("classify")
        tokens = self.check_texts(texts)
        rows = await self.submit(("classify",), texts, tokens)
        labels = self.frontend.labels
        out = []
        for text, probs in zip(texts, rows):
            best = max(range(len(probs)), key=probs.__getitem__)
            out.append({"text": text, "label": labels[best], "probability": probs[best],
                        "probabilities": dict(zip(labels, probs))})
        return {"model": self.name, "results": out}

    async def embed(self, texts: list[str], pooling: str | None) -> dict:
        """Sentence embeddings as :meth:`qkv.frontends.Encoder.embed` gives them (L2-normalised where the
        model says so: an imported sentence-transformers model with its Normalize module)."""
        self.require("embed")
        tokens = self.check_texts(texts, may_be_empty=True)  # a blank text is embedded, as sentence-transformers does
        f = self.frontend
        pooling = pooling or f.default_pooling
        rows = await self.submit(("embed", pooling), texts, tokens)
        return {"model": self.name, "pooling": pooling, "normalized": bool(f.normalize),
                "dimension": len(rows[0]) if rows else f.model.cfg.d_model,
                "results": [{"text": t, "embedding": row} for t, row in zip(texts, rows)]}

    async def fill(self, texts: list[str], k: int) -> dict:
        self.require("fill")
        tokens = self.check_texts(texts)
        for i, text in enumerate(texts, 1):
            if "[MASK]" not in text:
                raise RequestError(422, f'text {i} has no [MASK] to fill, e.g. "the movie was [MASK]"')
        rows = await self.submit(("fill", k), texts, tokens)
        return {"model": self.name, "results": [
            {"text": t, "masks": [[{"piece": p, "probability": v} for p, v in m] for m in row]}
            for t, row in zip(texts, rows)]}

    def check_generate(self, prefix: str, max_new_tokens: int) -> None:
        self.require("generate")
        if max_new_tokens > self.limits.max_new_tokens:
            raise RequestError(422, f"max_new_tokens {max_new_tokens} is more than this server allows "
                                    f"({self.limits.max_new_tokens})")
        self.check_texts([prefix], "prefix", self.frontend.tokenizer)

    def generation(self, prefix: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                   seed: int | None, stop: threading.Event) -> Iterator[str]:
        """The pieces of a continuation (to run on the worker thread); ``stop`` ends it early."""
        for piece in self.frontend.generate(prefix, max_new_tokens, temperature, top_k, top_p, seed):
            if stop.is_set():
                return
            yield piece

    # --- the batch, on the worker thread --------------------------------------------------------------

    def run_batch(self, key: Hashable, items: list) -> list:
        f = self.frontend
        if key[0] == "translate":
            _, beam, n_best, prefix, alignments, attention = key
            return f.translate_rich(items, target_prefix=prefix, alignments=alignments, attention=attention,
                                    beam_size=beam, nbest=n_best)
        if key[0] == "score":
            return f.score([s for s, _ in items], [t for _, t in items])
        if key[0] == "classify":
            return f.probabilities(items).tolist()
        if key[0] == "fill":
            return [f.fill(text, key[1]) for text in items]
        if key[0] == "embed":
            return f.embed(items, key[1]).tolist()
        raise ValueError(f"unknown batch kind {key[0]!r}")


def load_models(paths: list[str], limits: Limits, device: str = "cpu", load: Callable | None = None,
                engine: str = "qkv", quantize: str | None = None, threads: int = 0, decode: dict | None = None,
                log: Callable[[str], None] | None = None, compile: bool = False,
                engine_timeout: float | None = None) -> list[Served]:
    """The checkpoints ``paths`` (``PATH`` or ``NAME=PATH``), each opened as its front-end, decoded by
    ``engine`` (``ctranslate2``: Transformers for translate, classify, mlm and lm, others refused by name); names
    made unique. ``decode``: DecodeConfig fields that replace a translation model's saved settings.
    ``compile``: translation Transformers search with their step compiled (qkv's engine);
    ``engine_timeout``: the seconds a CTranslate2 worker's call may go unanswered (ctranslate2)."""
    if load is None:
        load = open_with(engine, quantize, threads, log, compile, engine_timeout)
    if not paths:
        raise QkvError("give at least one checkpoint directory to serve, e.g. runs/default/best")
    served, names = [], set()
    for arg in paths:
        name, path = model_name(arg)
        unique, n = name, 2
        while unique in names:
            unique, n = f"{name}-{n}", n + 1
        names.add(unique)
        if engine == "ctranslate2":
            default_refused(path, decode, log)
        frontend = load(path, device)
        if decode and hasattr(frontend, "decode_cfg"):
            try:
                frontend.decode_cfg = dataclasses.replace(frontend.decode_cfg, **decode).validate()
            except QkvError as e:
                raise QkvError(f"{path}: {e}") from None
        model = Served(unique, frontend, limits, str(path))
        if not model.endpoints:
            raise QkvError(f"{path}: qkv serve has no endpoint for what this model offers "
                           f"({', '.join(sorted(frontend.offers))})")
        if "translate" in frontend.offers:  # the beam a request without beam_size gets: refused now, not then
            beam = frontend.decode_cfg.beam_size
            try:
                if beam > limits.max_beam:
                    raise QkvError(f"its beam size {beam} is more than --max-beam {limits.max_beam}")
                frontend.check_beam(beam)
            except QkvError as e:
                raise QkvError(f"{path}: every request that names no beam_size would be refused: {e} (give "
                               f"--beam-size, or --max-beam)") from None
        served.append(model)
    return served


def default_refused(path: Path, decode: dict | None, log: Callable[[str], None] | None) -> None:
    """Say, before the conversion, when CTranslate2 cannot decode a translation model's default
    settings as qkv does (the saved --length-norm gnmt): requests that name no beam_size get 422."""
    from qkv.engines.options import check_settings, saved_decoding

    saved = saved_decoding(Path(path))
    try:
        cfg = saved and dataclasses.replace(saved, **(decode or {})).validate()
    except QkvError:
        return  # refused by name when the model is loaded
    try:
        if cfg:
            check_settings(cfg)
    except QkvError as e:
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(
            f"note: {path}: requests that name no beam_size will be refused (422): {e}")


def open_with(engine: str, quantize: str | None, threads: int, log: Callable[[str], None] | None,
              compile: bool = False, timeout: float | None = None) -> Callable:
    """``load(path, device)`` for ``engine``: qkv's front-ends (``compile``: the translation
    Transformers' step compiled), or CTranslate2's (:func:`qkv.engines.load`: a translator, an encoder
    or a generator, by the checkpoint's task)."""
    if engine == "qkv":
        from qkv.frontends import load

        if timeout is not None:
            raise QkvError("--engine-timeout bounds a call of the CTranslate2 engine's worker: give --engine "
                           "ctranslate2")
        return lambda path, device: load(path, device, quantize, compile)
    if compile:
        raise QkvError(f"--compile compiles qkv's own decoding step: leave out --engine {engine}, or --compile")
    from qkv.engines import check_engine, load
    from qkv.engines.translator import check_timeout, stderr

    check_engine(engine)
    timeout = check_timeout(timeout)
    return lambda path, device: load(path, device, quantize, threads, log or stderr, timeout)


__all__ = ["Served", "RequestError", "ENDPOINTS", "load_models", "model_name"]

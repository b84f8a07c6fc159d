"""qkv: the Transformer of "Attention Is All You Need" and the recurrent models it replaced.

    import qkv
    model = qkv.load("runs/default/best")
    model.translate(["three hundred twenty-one"])
"""

__version__ = "0.1.0"


def load(path, device="cpu", quantize=None, engine="qkv", threads=0, compile=False, engine_timeout=None):
    """Load a checkpoint directory as its task's front-end (a :class:`qkv.frontends.Translator`,
    ``Encoder`` or ``LanguageModel``; see :func:`qkv.frontends.load`); ``quantize="int8"``: dynamic
    int8 quantisation for CPU decoding; ``compile=True``: a translation Transformer searches with
    its step compiled by ``torch.compile`` (:mod:`qkv.decoding.compiled`; faster on a GPU).

    ``engine="ctranslate2"``: the model run by CTranslate2 (:mod:`qkv.engines`; converted once, cached
    beside the checkpoint): a translation Transformer by its ``Translator``, a classify or mlm
    Transformer by its ``Encoder`` (pooling and heads in torch), a language-model Transformer by its
    ``Generator``; ``threads`` its intra-op threads (0: its default), ``quantize="int8"`` its int8
    compute type; it needs the export extra. A translator runs in a worker process that heals: one
    that ends is replaced, and a call it does not answer within ``engine_timeout`` seconds (default
    600) kills and replaces it; the call in flight then fails with :class:`qkv.errors.Unavailable`
    and the next one is answered."""
    if engine != "qkv":
        from qkv.engines import check_engine, load as load_ct2

        check_engine(engine)
        if compile:
            from qkv.errors import QkvError

            raise QkvError(f"compile=True compiles qkv's own decoding step: not with engine={engine!r}")
        return load_ct2(path, device, quantize, threads, timeout=engine_timeout)
    if engine_timeout is not None:
        from qkv.errors import QkvError

        raise QkvError("engine_timeout bounds a call of the CTranslate2 engine's worker: give engine='ctranslate2'")
    from qkv.frontends import load as _load

    return _load(path, device, quantize, compile)


def load_ensemble(paths, device="cpu", quantize=None):
    """Load translation checkpoints with one vocabulary as one :class:`qkv.frontends.Translator` that
    decodes with the mean of their distributions (see :func:`qkv.frontends.load_ensemble`)."""
    from qkv.frontends import load_ensemble as _load_ensemble

    return _load_ensemble(paths, device, quantize)


__all__ = ["load", "load_ensemble", "__version__"]

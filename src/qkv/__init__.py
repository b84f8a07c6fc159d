"""qkv: the Transformer of "Attention Is All You Need" and the recurrent models it replaced.

    import qkv
    model = qkv.load("runs/default/best")
    model.translate(["three hundred twenty-one"])
"""

__version__ = "0.1.0"


def load(path, device="cpu", quantize=None):
    """Load a checkpoint directory as its task's front-end (a :class:`qkv.frontends.Translator`,
    ``Encoder`` or ``LanguageModel``; see :func:`qkv.frontends.load`); ``quantize="int8"``: dynamic
    int8 quantisation for CPU decoding."""
    from qkv.frontends import load as _load

    return _load(path, device, quantize)


def load_ensemble(paths, device="cpu", quantize=None):
    """Load translation checkpoints with one vocabulary as one :class:`qkv.frontends.Translator` that
    decodes with the mean of their distributions (see :func:`qkv.frontends.load_ensemble`)."""
    from qkv.frontends import load_ensemble as _load_ensemble

    return _load_ensemble(paths, device, quantize)


__all__ = ["load", "load_ensemble", "__version__"]

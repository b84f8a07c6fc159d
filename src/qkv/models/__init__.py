"""Models. One dict maps an architecture name to its class (no registry framework)."""

from qkv.models.transformer import Transformer

MODELS = {"transformer": Transformer}


def build_model(cfg):
    """Instantiate the model class named by ``cfg.arch``."""
    return MODELS[cfg.arch](cfg)

"""Models. One dict maps an architecture name to its class (no registry framework)."""

from qkv.models.rnn_seq2seq import RNNSeq2Seq
from qkv.models.transformer import Transformer

MODELS = {"transformer": Transformer, "rnn": RNNSeq2Seq, "lstm": RNNSeq2Seq, "gru": RNNSeq2Seq}


def build_model(cfg):
    """Instantiate the model class named by ``cfg.arch``."""
    return MODELS[cfg.arch](cfg)

"""Models. One dict maps (task, architecture) to the model class (no registry framework).

    translate  transformer   Transformer             encoder-decoder (the paper's model)
    translate  rnn/lstm/gru  RNNSeq2Seq              recurrent encoder-decoder, optionally with attention
    classify   transformer   EncoderOnly             encoder + <cls>/mean pooling + linear head
    classify   rnn/lstm/gru  RNNClassifier           (bi)directional RNN + mean/last pooling + linear head
    mlm        transformer   EncoderOnly             encoder + tied masked-language-model head
    classify   rnn/lstm/gru  RNNClassifier           (bi)directional RNN + mean/last pooling + linear head
    lm         transformer   DecoderOnlyTransformer  causal self-attention, no cross-attention
    lm         rnn/lstm/gru  RNNLanguageModel        recurrent language model (truncated BPTT)
    prefix_lm  transformer   DecoderOnlyTransformer  "src <sep> tgt", loss on the target only
"""

from qkv.errors import ConfigError
from qkv.models.decoder_only import DecoderOnlyTransformer
from qkv.models.encoder_only import EncoderOnly
from qkv.models.rnn_classifier import RNNClassifier
from qkv.models.rnn_lm import RNNLanguageModel
from qkv.models.rnn_seq2seq import RNNSeq2Seq
from qkv.models.transformer import Transformer

MODELS = {
    ("translate", "transformer"): Transformer,
    ("translate", "rnn"): RNNSeq2Seq,
    ("translate", "lstm"): RNNSeq2Seq,
    ("translate", "gru"): RNNSeq2Seq,
    ("classify", "transformer"): EncoderOnly,
    ("classify", "rnn"): RNNClassifier,
    ("classify", "lstm"): RNNClassifier,
    ("classify", "gru"): RNNClassifier,
    ("mlm", "transformer"): EncoderOnly,
    ("lm", "transformer"): DecoderOnlyTransformer,
    ("lm", "rnn"): RNNLanguageModel,
    ("lm", "lstm"): RNNLanguageModel,
    ("lm", "gru"): RNNLanguageModel,
    ("prefix_lm", "transformer"): DecoderOnlyTransformer,
}


def build_model(cfg):
    """Instantiate the model class for ``(cfg.task, cfg.arch)``."""
    key = (getattr(cfg, "task", "translate"), cfg.arch)
    if key not in MODELS:
        archs = sorted(a for t, a in MODELS if t == key[0])
        raise ConfigError(f"invalid config field 'arch': no {key[1]!r} model for task {key[0]!r} "
                          f"(this task has: {', '.join(archs) or 'none'})")
    return MODELS[key](cfg)

"""Configuration: frozen dataclasses per area, named presets, TOML files, validation.

``ModelConfig`` describes the network, ``TrainConfig`` the optimisation and data, and
``DecodeConfig`` the search. Presets follow the paper (Table 3): ``base`` is the base model,
``big`` the big one; ``tiny`` is for tests and ``small`` for CPU-sized experiments.

Configs are never mutated: derive a new one with :func:`dataclasses.replace`. Every field is
checked by ``validate()``, which names the field at fault in a :class:`~qkv.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from qkv.bounds import (MAX_BEAM, MAX_LAYERS, MAX_LENGTH_PENALTY, MAX_SEED, MAX_STEPS, MAX_THREADS, MAX_VOCAB,
                        MAX_WIDTH, Bound, real, whole)
from qkv.errors import ConfigError

# Special token ids, fixed across the project (tokenizer, models, batching, decoding).
PAD, UNK, BOS, EOS = 0, 1, 2, 3
# Pieces the monolingual tasks add to the SentencePiece model as user-defined symbols, at these
# fixed ids right after the four specials: the classification token, the MLM mask, a separator.
CLS, MASK, SEP = 4, 5, 6
CLS_PIECE, MASK_PIECE, SEP_PIECE = "<cls>", "[MASK]", "<sep>"

# What a model is trained to do (see qkv.tasks): the structure of the model depends on it.
TASKS = ("translate", "classify", "mlm", "lm", "prefix_lm")
POOLINGS = ("cls", "mean", "last")
# ModelConfig.activation: the FFN's function between W_1 and W_2 (qkv.nn.feed_forward): the paper's
# ReLU, GELU exact (BERT) or tanh-approximated (GPT-2), SiLU/swish (Marian)
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
POOLER_ACTIVATIONS = ("tanh", "relu", "gelu")  # ModelConfig.pooler_activation
INITS = ("xavier", "fairseq")  # ModelConfig.init: how the Transformer layers' linear maps start
FINAL_NORMS = ("auto", "on", "off")  # ModelConfig.final_norm: a LayerNorm after a stack's last layer
SINUSOID_LAYOUTS = ("interleaved", "halves")  # ModelConfig.sinusoid_layout: where sin and cos sit

RNN_ARCHS = ("rnn", "lstm", "gru")  # recurrent encoder-decoders (models/rnn_seq2seq.py)
ARCHS = ("transformer",) + RNN_ARCHS
ATTENTION_SCORES = ("none", "dot", "scaled_dot", "general", "additive", "cosine", "location")
SCHEDULES = ("noam", "constant", "inverse_sqrt")
# none: no positions at all (a bag of tokens to attention); rotary: RoPE, q and k rotated by position (Llama);
# relative: T5's learned per-head bias of the bucketed key-query distance, added to the attention logits
POSITIONALS = ("sinusoidal", "learned", "none", "rotary", "relative")
NORMS = ("layernorm", "rmsnorm")  # ModelConfig.norm: every norm of a Transformer stack (qkv.nn.norm)
DEFAULT_LR = 1e-3  # the rate of the constant and inverse_sqrt schedules when TrainConfig.lr = 0
# Bounds beyond which torch fails outright: a position table of 10**9 rows exhausts memory; thousands
# of OpenMP threads fail to start (about 31,000 segfaulted a 2-core machine, at its memory-map limit).
# (MAX_THREADS, MAX_SEED and the other ranges of qkv.bounds)
MAX_POSITIONS = 65536
MAX_OUTPUT_LEN = 1024  # tokens: the absolute cap on a decoding budget, whatever max_len_a and max_len_b say


def setting(default: Any, help: str, hidden: bool = False, bound: Bound | None = None) -> Any:
    """A config field with its help text (``--help`` shows it; ``hidden``: filled in by qkv, no flag)
    and, for a number, its :class:`~qkv.bounds.Bound` (its flag refuses a value beyond it as it is
    read; ``validate()`` refuses one from a file)."""
    return dataclasses.field(default=default, metadata={"help": help, "hidden": hidden, "bound": bound})


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"invalid config field '{field}': {msg}")


def did_you_mean(value: Any, choices: Any) -> str:
    """" (did you mean 'X'?)" for a mistyped ``value`` close to one of ``choices`` (difflib's ratio >= 0.6), else ""."""
    import difflib

    near = difflib.get_close_matches(value, list(choices), n=1) if isinstance(value, str) else []
    return f" (did you mean {near[0]!r}?)" if near else ""


def _check_finite(cfg: Any) -> None:
    """Every float field of a config is a finite number: inf and nan pass every comparison of the
    checks that follow, or fail them obscurely, and no setting of qkv means anything by them; and
    every number is within its field's bound (:mod:`qkv.bounds`), wherever it came from."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        _check(f.type != "float" or math.isfinite(v), f.name, f"must be a finite number, got {v}")
        bound = f.metadata.get("bound")
        problem = bound.problem(v) if bound is not None else None
        _check(problem is None, f.name, problem or "")


@dataclass(frozen=True)
class ModelConfig:
    """The network. Defaults are the paper's base model (Table 3, row "base")."""

    # every model: its task and architecture, width, depth and dropout
    task: str = setting(
        "translate",
        'translate | classify (labelled text -> label) | mlm (masked-LM pretraining of an encoder) | lm | '
        'prefix_lm')
    arch: str = setting(
        "transformer",
        'architecture: transformer | lstm | gru | rnn (a recurrent encoder-decoder, see --attention; with '
        '--task lm a recurrent language model, with --task classify a recurrent classifier)')
    d_model: int = setting(512, 'model width d_model (recurrent models: embedding and hidden size)',
        bound=whole(1, MAX_WIDTH))
    n_encoder_layers: int = setting(6, 'encoder layers N (stacked recurrent layers for lstm/gru/rnn)',
        bound=whole(1, MAX_LAYERS))
    n_decoder_layers: int = setting(6, 'decoder layers N (stacked recurrent layers for lstm/gru/rnn)',
        bound=whole(1, MAX_LAYERS))
    dropout: float = setting(
        0.1,
        'P_drop on embedding sums and sublayer outputs (recurrent: embeddings, between layers, h~)', bound=real(0, 1))
    # the Transformers (arch transformer): attention, FFN, positions, normalisation, shared embeddings
    n_heads: int = setting(8, 'attention heads h (d_k = d_v = d_model / h)', bound=whole(1, MAX_LAYERS))
    d_ff: int = setting(2048, 'inner width of the position-wise FFN', bound=whole(1, 16 * MAX_WIDTH))
    attention_dropout: float = setting(0.1, 'dropout on attention weights', bound=real(0, 1))
    positional: str = setting(
        "sinusoidal",
        'sinusoidal | learned | none (no positions: order is invisible to attention) | rotary (RoPE: q and k '
        "rotated by their position inside attention, as Llama) | relative (T5's bucketed relative-position bias "
        'on the attention logits, one table shared by the layers of a stack)')
    max_positions: int = setting(
        1024,
        'positions in the (learned or initial sinusoidal) table, at most 65536; learned positions must cover '
        "max_len and the task's special tokens", bound=whole(1, MAX_POSITIONS))
    norm_first: bool = setting(False, "pre-norm residual blocks instead of the paper's post-norm")
    activation: str = setting(
        "relu",
        "the position-wise FFN's activation: relu (the paper's max(0, x)) | gelu (exact, as BERT) | gelu_tanh "
        "(GELU's tanh approximation, as GPT-2) | silu (x·sigmoid(x), swish, as Marian)")
    scale_embeddings: bool = setting(
        True, "multiply the token embeddings by √d_model (the paper's; BERT and GPT-2 do not)")
    type_vocab_size: int = setting(
        0,
        "classify/mlm: a learned token-type (segment) embedding table of this many rows, row 0 added at every "
        "position (BERT's; qkv's inputs are one text, segment 0); 0: none", bound=whole(0, 1024))
    embedding_norm: bool = setting(
        False, "classify/mlm: a LayerNorm on embeddings + positions (+ token types) before the first layer (BERT's); "
        "translate: one on each stack's, encoder and decoder (BART's layernorm_embedding)")
    layer_norm_eps: float = setting(
        1e-5, "ε of every LayerNorm (added to the variance); torch's default 1e-5, BERT's 1e-12",
        bound=real(1e-30, 1.0))
    init: str = setting(
        "xavier",
        "initialisation of the Transformer layers' linear maps: xavier (Xavier-uniform weights, zero biases) | "
        "fairseq (as fairseq's Transformer: FFN weights and biases and the Q, K, V biases U(±1/√fan_in))")
    final_norm: str = setting(
        "auto",
        "a LayerNorm after the last layer of each stack: auto (with pre-norm layers, as GPT-2's ln_f; none with "
        "the paper's post-norm ones) | on | off")
    sinusoid_layout: str = setting(
        "interleaved",
        "sinusoidal positions: interleaved (the paper's PE(pos, 2i) = sin, PE(pos, 2i+1) = cos) | halves "
        "(Marian's: the sines in the first d/2 dimensions, the cosines in the second)")
    output_bias: bool = setting(False, "a learned bias on the output logits (Marian's final_logits_bias)")
    share_embeddings: bool = setting(True, 'share source/target/output embeddings (needs a joint vocabulary)')
    tie_output: bool = setting(True, 'share the target embedding with the pre-softmax projection')
    # family switches: positions, norms, FFN, attention (the paper's values by default; each is one choice
    # of the one stack in qkv.nn: rotary.py, relative.py, norm.py, feed_forward.py, attention.py)
    rope_theta: float = setting(
        10000.0, "positional rotary: the base θ of RoPE's frequencies θ^(-2i/d_k) (Llama's 10000, Qwen2's 1e6)",
        bound=real(1.0, 1e9))
    relative_buckets: int = setting(
        32, "positional relative: T5's distance buckets (half per direction in an encoder)", bound=whole(2, 4096))
    relative_max_distance: int = setting(
        128, "positional relative: the distance from which on every distance shares the last bucket (T5's 128)",
        bound=whole(1, MAX_POSITIONS))
    norm: str = setting(
        "layernorm",
        "every norm of a Transformer stack: layernorm (the paper's: (x - mean) / std · g + b) | rmsnorm "
        "(x / RMS(x) · g, as T5 and Llama)")
    norm_bias: bool = setting(True, "a learned bias in every norm (LayerNorm's b; T5 and Llama have none)")
    ffn_gated: bool = setting(
        False,
        "gated FFN: (act(x W_1) ⊙ x W_3) W_2 instead of act(x W_1) W_2: SwiGLU with activation silu (Llama), "
        "GeGLU with gelu or gelu_tanh (T5 v1.1's gated-gelu)")
    ffn_bias: bool = setting(True, "biases in the FFN's linear maps (the paper's b_1, b_2; T5 and Llama have none)")
    n_kv_heads: int = setting(
        0,
        "key/value heads: 0 = n_heads (the paper's); fewer = grouped-query attention, each shared by "
        "n_heads / n_kv_heads query heads (1: multi-query)", bound=whole(0, MAX_LAYERS))
    qkv_bias: bool = setting(True, "biases on the Q, K, V projections (the paper's; Qwen2 has them, Llama and T5 not)")
    out_bias: bool = setting(True, "a bias on the attention's output projection W^O (Llama, Qwen2 and T5 have none)")
    attention_scale: bool = setting(
        True, "divide the attention logits by √d_k (eq. 1); false: T5's attention, the scale folded into W^Q")
    # family switches: embeddings and layer sharing (the paper's values are the defaults)
    position_offset: int = setting(
        0,
        "learned positions: rows of the table before position 0 (RoBERTa's padding_idx + 1 = 2, BART's 2): the "
        "table has max_positions + position_offset rows and position t reads row t + position_offset",
        bound=whole(0, 1024))
    embedding_dim: int = setting(
        0,
        "classify/mlm: width of the token, position and token-type embeddings (and their LayerNorm), projected to "
        "d_model before the first layer (ALBERT's factorised embedding, ELECTRA's embedding_size); 0: d_model",
        bound=whole(0, MAX_WIDTH))
    layer_groups: int = setting(
        0,
        "classify/mlm: sets of encoder-layer weights that the N layers run from, consecutive layers sharing one "
        "(ALBERT's num_hidden_groups: layer i uses set floor(i·groups/N); 1: every layer the same weights); "
        "0: each layer its own", bound=whole(0, MAX_LAYERS))
    pooler_activation: str = setting(
        "tanh",
        "classify with --pooler: the pooler's function, f(W h + b): tanh (BERT's pooler, RoBERTa's head) | relu "
        "(DistilBERT's) | gelu (ELECTRA's)")
    mlm_head_activation: str = setting(
        "gelu",
        "mlm: the masked-LM head's function between its dense layer and LayerNorm: gelu (BERT, RoBERTa) | gelu_tanh "
        "(ALBERT) | relu | silu")
    pooler_dropout: bool = setting(
        False,
        "classify with --pooler: dropout before the pooler's W too (RoBERTa's and ELECTRA's heads: dropout, "
        "dense, f, dropout, out), not only after it (BERT's)")
    # the recurrent models (arch rnn | lstm | gru): d_model is the embedding and hidden size,
    # n_encoder_layers / n_decoder_layers the stacked layers, dropout between layers and on embeddings
    rnn_nonlinearity: str = setting(
        "tanh",
        'f of the vanilla RNN h_t = f(V·h_{t-1} + U·x_t + b) (--arch rnn): tanh | relu')
    bidirectional: bool = setting(True, 'recurrent models: bidirectional encoder, states [h→; h←]')
    attention: str = setting(
        "additive",
        "recurrent models: alignment score of the decoder's attention over the encoder states: none (context "
        'vector only) | dot | scaled_dot | general | additive | cosine | location')
    input_feeding: bool = setting(
        False,
        'recurrent models with attention: feed h~_{t-1} into the decoder input (Luong et al.; slower '
        'training: the decoder then runs step by step)')
    # the classifier's head (task classify)
    pooling: str = setting(
        "cls",
        "classify: cls (the <cls> token's state) | mean (over non-padding positions) | last (RNN final "
        'states)')
    pooler: bool = setting(
        False, "classify: BERT's pooler, tanh(W h + b), on the pooled state before the classifier")
    mlm_head: bool = setting(
        True,
        'mlm: the masked-LM head (false: an encoder imported without one, e.g. BertModel or a sentence-transformers '
        'model, for embed and search; fill and mlm training need the head)')
    n_classes: int = setting(0, 'classify: filled in from the training labels', hidden=True)
    # filled in from the tokenizer
    src_vocab_size: int = setting(0, 'filled in from the tokenizer', hidden=True)
    tgt_vocab_size: int = setting(0, 'filled in from the tokenizer', hidden=True)

    @property
    def is_recurrent(self) -> bool:
        return self.arch in RNN_ARCHS

    def validate(self) -> "ModelConfig":
        _check_finite(self)
        _check(self.max_positions <= MAX_POSITIONS, "max_positions",
               f"must be at most {MAX_POSITIONS}, got {self.max_positions}")
        _check(self.arch in ARCHS, "arch", f"unknown architecture {self.arch!r}{did_you_mean(self.arch, ARCHS)}; choose one of {', '.join(ARCHS)}")
        _check(self.task in TASKS, "task", f"unknown task {self.task!r}{did_you_mean(self.task, TASKS)}; choose one of {', '.join(TASKS)}")
        _check(self.pooling in POOLINGS, "pooling", f"must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        _check(self.n_classes >= 0, "n_classes", f"must be >= 0, got {self.n_classes}")
        if self.task == "classify" and self.n_classes:
            _check(self.n_classes >= 2, "n_classes", f"a classifier needs at least 2 classes, got {self.n_classes}")
        if self.task not in ("classify", "mlm") or self.is_recurrent:
            for name in ("type_vocab_size", "embedding_norm", "pooler"):
                if name == "embedding_norm":  # also BART's layernorm_embedding, on each stack of translate
                    _check(not self.embedding_norm or (self.task == "translate" and not self.is_recurrent), name,
                           "only the Transformer encoder of classify and mlm, and the Transformer of translate, "
                           "have it")
                    continue
                _check(not getattr(self, name), name, "only the Transformer encoder of classify and mlm has it")
        _check(self.task == "classify" or not self.pooler, "pooler", "only a classifier has it")
        if self.task not in ("classify", "mlm") or self.is_recurrent:
            for name in ("embedding_dim", "layer_groups"):
                _check(not getattr(self, name), name, "only the Transformer encoder of classify and mlm has it")
        _check(self.layer_groups <= self.n_encoder_layers, "layer_groups",
               f"{self.layer_groups} sets of weights for {self.n_encoder_layers} layers: at most one set a layer")
        _check(self.positional == "learned" or not self.position_offset, "position_offset",
               "offsets a learned position table; set positional = learned")
        _check(self.pooler_activation in POOLER_ACTIVATIONS, "pooler_activation",
               f"must be one of {', '.join(POOLER_ACTIVATIONS)}, got {self.pooler_activation!r}")
        _check(self.mlm_head_activation in ACTIVATIONS, "mlm_head_activation",
               f"must be one of {', '.join(ACTIVATIONS)}, got {self.mlm_head_activation!r}")
        if self.task == "classify" and self.arch == "transformer":
            _check(self.pooling != "last", "pooling", "'last' (the last RNN state) needs a recurrent arch; "
                   "a Transformer encoder pools 'cls' or 'mean'")
        if self.task == "classify" and self.arch != "transformer":
            _check(self.pooling != "cls", "pooling", "'cls' needs a Transformer encoder; a recurrent classifier "
                   "pools 'mean' (over valid positions) or 'last' (the final states)")
        for name in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers", "max_positions"):
            _check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _check(self.final_norm in FINAL_NORMS, "final_norm",
               f"must be one of {', '.join(FINAL_NORMS)}, got {self.final_norm!r}")
        _check(self.sinusoid_layout in SINUSOID_LAYOUTS, "sinusoid_layout",
               f"must be one of {', '.join(SINUSOID_LAYOUTS)}, got {self.sinusoid_layout!r}")
        _check(self.activation in ACTIVATIONS, "activation",
               f"unknown activation {self.activation!r}{did_you_mean(self.activation, ACTIVATIONS)}; choose one of "
               f"{', '.join(ACTIVATIONS)}")
        _check(self.init in INITS, "init", f"must be one of {', '.join(INITS)}, got {self.init!r}")
        _check(self.rnn_nonlinearity in ("tanh", "relu"), "rnn_nonlinearity",
               f"must be tanh or relu, got {self.rnn_nonlinearity!r}")
        _check(self.attention in ATTENTION_SCORES, "attention",
               f"unknown attention {self.attention!r}{did_you_mean(self.attention, ATTENTION_SCORES)}; choose one of {', '.join(ATTENTION_SCORES)}")
        if self.is_recurrent:
            _check(not (self.input_feeding and self.attention == "none"), "input_feeding",
                   "input feeding passes the attentional state on; it needs an attention score, not 'none'")
            return self._validate_common()
        _check(
            self.d_model % self.n_heads == 0,
            "n_heads",
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}",
        )
        _check(self.norm in NORMS, "norm", f"must be one of {', '.join(NORMS)}, got {self.norm!r}")
        _check(self.n_kv_heads == 0 or self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
               f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        _check(self.positional != "rotary" or self.d_k % 2 == 0, "positional",
               f"rotary positions rotate pairs of dimensions: d_k = d_model / n_heads = {self.d_k} must be even")
        return self._validate_common()

    def _validate_common(self) -> "ModelConfig":
        if self.positional == "sinusoidal" and not self.is_recurrent:
            _check(self.d_model % 2 == 0, "d_model", "sinusoidal positions need an even d_model")
        for name in ("dropout", "attention_dropout"):
            v = getattr(self, name)
            _check(0.0 <= v < 1.0, name, f"must be in [0, 1), got {v}")
        _check(self.positional in POSITIONALS, "positional", f"must be one of {', '.join(POSITIONALS)}, got {self.positional!r}")
        _check(self.src_vocab_size >= 0 and self.tgt_vocab_size >= 0, "src_vocab_size", "must be >= 0")
        if self.share_embeddings and self.src_vocab_size and self.tgt_vocab_size:
            _check(
                self.src_vocab_size == self.tgt_vocab_size,
                "share_embeddings",
                f"sharing needs one vocabulary, got {self.src_vocab_size} and {self.tgt_vocab_size}",
            )
        return self

    @property
    def has_final_norm(self) -> bool:
        """Whether each stack ends with a LayerNorm (``final_norm``; auto: with pre-norm layers)."""
        return self.norm_first if self.final_norm == "auto" else self.final_norm == "on"

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or ``n_heads`` when it is 0 (the paper's attention)."""
        return self.n_kv_heads or self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and data. Defaults follow the paper's setup (section 5)."""

    # data
    tokenizer: str = setting("bpe", 'SentencePiece model type: bpe | unigram | char')
    tokenizer_from: str = setting(
        "",
        'reuse the tokenizer of this checkpoint directory (or a SentencePiece .model) instead of training '
        'one, e.g. to compare models on one subword vocabulary')
    vocab_size: int = setting(8000, 'SentencePiece vocabulary size (a cap for char)', bound=whole(1, MAX_VOCAB))
    joint_vocab: bool = setting(True, 'one vocabulary for source and target')
    max_len: int = setting(
        256,
        'translate: skip (and count) training pairs longer than this many tokens; classify/mlm: keep the '
        'first max_len tokens of each text', bound=whole(1, MAX_WIDTH))
    keep_tail: int = setting(
        0,
        'classify/mlm: a text longer than max_len keeps its first max_len - keep_tail tokens and its last '
        'keep_tail (head + tail, Sun et al. 2019); 0: the head only', bound=whole(0, MAX_WIDTH))
    max_tokens: int = setting(4096, "token budget per batch (padded), as fairseq's --max-tokens", bound=whole(1, 10**8))
    # optimisation
    schedule: str = setting(
        "noam",
        "learning-rate schedule: noam (the paper's warmup + inverse sqrt, see --lr-scale) | constant (--lr) |"
        ' inverse_sqrt (linear warmup to --lr, then lr·sqrt(warmup/step)); a recurrent model (arch rnn, lstm, '
        'gru) trains at a constant rate (1e-3; 2e-3 on the embedded task) unless schedule or lr_scale is set')
    lr: float = setting(0.0, 'rate of the constant and inverse_sqrt schedules (0: 1e-3); noam ignores it',
        bound=real(0, 1000))  # 1000 diverges at once: what the divergence guard answers
    lr_scale: float = setting(1.0, 'factor on the warmup schedule d^-0.5·min(step^-0.5, step·warmup^-1.5)',
        bound=real(0, 100))
    warmup_steps: int = setting(4000, 'linear warmup steps of the schedule', bound=whole(1, MAX_STEPS))
    cooldown_steps: int = setting(
        0,
        'the last this many updates before max_steps: the rate of the schedule falls linearly to nearly 0 '
        '(times (max_steps - step + 1) / cooldown_steps), so that training ends on a quiet model; a shorter run'
        ' cools down over all its updates (0: none)',
        bound=whole(0, MAX_STEPS))
    optimizer: str = setting(
        "adam",
        "adam (the paper's, with adam_beta1/2 and adam_eps) | nag: SGD with Nesterov momentum, fairseq 0.9's "
        "default optimizer (torch.optim.SGD(nesterov=True); the same update as fairseq's NAG)")
    momentum: float = setting(0.99, "momentum of nag (fairseq's default 0.99)", bound=real(0, 1))
    adam_beta1: float = setting(0.9, 'Adam β1', bound=real(0, 1))
    adam_beta2: float = setting(0.98, 'Adam β2', bound=real(0, 1))
    adam_eps: float = setting(1e-9, 'Adam ε', bound=real(0, 1))
    weight_decay: float = setting(0.0, 'L2 weight decay (the paper uses none)', bound=real(0, 10))
    label_smoothing: float = setting(0.1, 'ε_ls of the label-smoothed cross-entropy', bound=real(0, 1))
    clip_norm: float = setting(1.0, 'clip the gradient norm to this (0: off)', bound=real(0, 10**6))
    nonfinite_limit: int = setting(
        10,
        'an update whose loss or gradient norm is not finite (NaN/inf) is skipped with a warning; this many '
        'in a row stop training with exit status 3 (non-finite weights are never saved)', bound=whole(1, 10**6))
    update_freq: int = setting(1, 'accumulate gradients over this many batches per update', bound=whole(1, MAX_WIDTH))
    update_tokens: int = setting(
        0,
        "tokens per side of one update, over all processes and accumulated batches (the paper's 25,000 source "
        "+ 25,000 target tokens: 25000); when set, each batch's budget max_tokens is computed at start as "
        "update_tokens / (processes x update_freq), so the update keeps its size on any number of GPUs "
        "(0: max_tokens as given, per process and batch)", bound=whole(0, 10**8))
    max_steps: int = setting(100_000, 'stop after this many updates', bound=whole(1, MAX_STEPS))
    max_epochs: int = setting(0, 'stop after this many epochs (0: no limit)', bound=whole(0, MAX_STEPS))
    max_time: float = setting(0.0, 'stop after this many seconds of training (0: no limit)', bound=real(0, 10**8))
    patience: int = setting(
        0,
        'early stopping: stop once this many validations in a row bring no new best of the selection metric '
        '(translation: validation loss; 0: never)', bound=whole(0, MAX_STEPS))
    lr_shrink: float = setting(
        1.0,
        "reduce on plateau: when patience runs out, multiply the learning rate by this and go on (fairseq's "
        '--lr-shrink), up to max_lr_shrinks times; then stop', bound=real(0, 1))
    max_lr_shrinks: int = setting(
        0,
        'how many times the rate may shrink before patience stops training (0: stop at once)', bound=whole(0, 10**4))
    # evaluation and checkpoints
    eval_every: int = setting(1000, 'validate and checkpoint every this many updates', bound=whole(1, MAX_STEPS))
    first_eval: int = setting(0, 'validate and checkpoint at this update too, before the first eval_every, so a '
                                 'curve starts early (0: no early validation)', bound=whole(0, MAX_STEPS))
    eval_bleu_samples: int = setting(
        200, "validation sentences decoded greedily for BLEU, each output at most 2 x its reference's tokens + 5",
        bound=whole(0, 10**8))
    clean_html: bool = setting(
        True,
        'classify / mlm: HTML line breaks (<br />, as in IMDb reviews) become spaces in the training texts and in '
        'every text the saved model reads later (recorded with the model; an imported model reads texts as given)')
    mask_prob: float = setting(
        0.15,
        'mlm: share of tokens chosen for prediction (of those 80% -> [MASK], 10% random, 10% kept)', bound=real(0, 1))
    init_from: str = setting(
        "",
        "start from this checkpoint's weights where names and shapes match (e.g. a classifier from an mlm "
        "run's encoder; its tokenizer and architecture are used)")
    keep_last: int = setting(
        0,
        'also keep the newest K numbered step_N/ checkpoints, saved at each validation (for averaging)',
        bound=whole(0, 10**6))
    seed: int = setting(1, 'random seed', bound=whole(0, MAX_SEED))
    threads: int = setting(0, "torch CPU threads (0: torch's default; at most 1024)", bound=whole(0, MAX_THREADS))
    # hardware (any of these may change on --resume; checkpoints are device-independent)
    device: str = setting(
        "auto",
        'auto (CUDA when available) | cpu | cuda; under torchrun each process takes the GPU of its LOCAL_RANK')
    amp: str = setting(
        "none",
        'mixed precision of the training forward: none | bf16 | fp16 (CUDA only, with a gradient scaler)')
    compile: bool = setting(
        False,
        'torch.compile the training step: forward and loss as one graph with its backward, batches padded to '
        'multiples of 8 (slow first steps, faster later ones)')
    fused_loss: bool = setting(
        True,
        'on the CPU, compute the output projection and the label-smoothed loss together, chunk by chunk, without'
        ' the full (tokens x vocabulary) logits (same values; faster there; on a GPU the logits are made, which'
        ' measured faster; Transformers and recurrent seq2seq)')

    def validate(self) -> "TrainConfig":
        _check_finite(self)
        _check(0 <= self.seed <= MAX_SEED, "seed", f"must be in [0, 2**63 - 1], got {self.seed}")
        _check(self.threads <= MAX_THREADS, "threads", f"must be at most {MAX_THREADS} (0: torch's default), "
               f"got {self.threads}")
        _check(self.tokenizer in ("bpe", "unigram", "char"), "tokenizer", "must be bpe, unigram or char")
        for name in ("vocab_size", "max_len", "max_tokens", "warmup_steps", "update_freq", "max_steps", "eval_every"):
            _check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _check(self.keep_tail < self.max_len, "keep_tail", f"must be below max_len={self.max_len}, got {self.keep_tail}")
        _check(self.max_tokens >= self.max_len + 2, "max_tokens", f"must hold one sentence of max_len={self.max_len} (+2)")
        _check(self.lr_scale > 0, "lr_scale", "must be positive")
        _check(self.cooldown_steps >= 0, "cooldown_steps", f"must be >= 0, got {self.cooldown_steps}")
        _check(self.schedule in SCHEDULES, "schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        _check(self.lr >= 0, "lr", f"must be >= 0 (0: the default {DEFAULT_LR:g}), got {self.lr}")
        _check(not (self.schedule == "noam" and self.lr > 0), "lr",
               "the noam schedule sets its own rate (scale it with lr_scale); lr is for constant and inverse_sqrt")
        _check(not (self.schedule != "noam" and self.lr_scale != 1.0), "lr_scale",
               f"lr_scale scales the noam schedule only; with schedule={self.schedule!r} set lr")
        _check(0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0, "adam_beta1", "betas must be in [0, 1)")
        _check(self.adam_eps > 0, "adam_eps", "must be positive")
        _check(self.optimizer in ("adam", "nag"), "optimizer", f"must be adam or nag, got {self.optimizer!r}")
        _check(0.0 < self.momentum < 1.0, "momentum", f"must be in (0, 1), got {self.momentum}")
        _check(0.0 <= self.label_smoothing < 1.0, "label_smoothing", "must be in [0, 1)")
        _check(self.clip_norm >= 0, "clip_norm", "must be >= 0")
        _check(self.nonfinite_limit >= 1, "nonfinite_limit", f"must be >= 1, got {self.nonfinite_limit}")
        _check(0.0 < self.mask_prob < 1.0, "mask_prob", f"must be in (0, 1), got {self.mask_prob}")
        _check(0.0 < self.lr_shrink <= 1.0, "lr_shrink", f"must be in (0, 1], got {self.lr_shrink}")
        _check(not (self.max_lr_shrinks and self.lr_shrink == 1.0), "max_lr_shrinks",
               "shrinks the rate by lr_shrink, which is 1.0 (no change): set lr_shrink below 1")
        _check(not (self.max_lr_shrinks and not self.patience), "max_lr_shrinks",
               "the rate shrinks when patience runs out: set patience too")
        for name in ("max_epochs", "max_time", "patience", "max_lr_shrinks", "eval_bleu_samples", "keep_last", "threads", "weight_decay",
                     "update_tokens"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")
        _check(self.device in ("auto", "cpu", "cuda"), "device", f"must be auto, cpu or cuda, got {self.device!r}")
        _check(self.amp in ("none", "bf16", "fp16"), "amp", f"must be none, bf16 or fp16, got {self.amp!r}")
        _check(not (self.amp == "fp16" and self.device == "cpu"), "amp",
               "fp16 (with its GradScaler) needs a CUDA GPU; on the CPU use bf16 or none")
        return self


@dataclass(frozen=True)
class DecodeConfig:
    """Search. Defaults are the paper's: beam 4, length penalty alpha 0.6, max length = input + 50."""

    beam_size: int = setting(4, 'beam size (1: greedy)', bound=whole(1, MAX_BEAM))
    length_penalty: float = setting(
        0.6,
        'α of the length penalty: beam search ranks log P(Y|x) / lp(Y), lp = ((5+|Y|)/6)^α (gnmt) or |Y|^α '
        '(length)', bound=real(0, MAX_LENGTH_PENALTY))
    length_norm: str = setting(
        "gnmt",
        "gnmt: lp = ((5+|Y|)/6)^α (Wu et al., 2016; the paper) | length: lp = |Y|^α (fairseq's --lenpen, "
        "Hugging Face's length_penalty)")
    early_stopping: bool = setting(
        False,
        "end a sentence's search as soon as beam_size hypotheses have ended (fairseq's rule; favours short "
        'outputs) instead of when no live one can beat them')
    max_len_a: float = setting(
        1.0,
        'max output length = a·source length + b, at most 1024 tokens (a and b: at most 1024 each) and what '
        'learned positions allow', bound=real(0, MAX_OUTPUT_LEN))
    max_len_b: int = setting(
        50,
        'max output length = a·source length + b, at most 1024 tokens (a and b: at most 1024 each) and what '
        'learned positions allow', bound=whole(0, MAX_OUTPUT_LEN))
    min_len: int = setting(0, 'no EOS before this many output tokens', bound=whole(0, MAX_OUTPUT_LEN))
    nbest: int = setting(1, 'hypotheses to output per sentence', bound=whole(1, MAX_BEAM))
    batch_size: int = setting(64, 'sentences per decoding batch', bound=whole(1, MAX_WIDTH))
    scripted_greedy: bool = setting(
        True,
        "greedy search of a Transformer on the CPU runs its loop in TorchScript: the same outputs and scores "
        "with less Python per step (qkv.decoding.scripted); off: the eager loop")

    def validate(self) -> "DecodeConfig":
        _check_finite(self)
        _check(self.beam_size >= 1, "beam_size", "must be >= 1")
        _check(self.length_penalty >= 0, "length_penalty", "must be >= 0")
        _check(self.length_norm in ("gnmt", "length"), "length_norm", f"must be gnmt or length, got {self.length_norm!r}")
        for name in ("max_len_a", "max_len_b"):  # beyond the cap, a value would only ever mean the cap
            v = getattr(self, name)
            _check(0 <= v <= MAX_OUTPUT_LEN, name, f"must be in [0, {MAX_OUTPUT_LEN}] (no output is longer than "
                   f"{MAX_OUTPUT_LEN} tokens), got {v:g}")
        _check(self.min_len >= 0, "min_len", "must be >= 0")
        _check(1 <= self.nbest <= self.beam_size, "nbest", f"must be in [1, beam_size={self.beam_size}]")
        _check(self.batch_size >= 1, "batch_size", "must be >= 1")
        return self


# --- presets -------------------------------------------------------------------------------------

MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        d_model=32, n_heads=2, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
        dropout=0.0, attention_dropout=0.0, max_positions=256,
    ),
    "small": ModelConfig(
        d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3,
        dropout=0.1, attention_dropout=0.1,
    ),
    "base": ModelConfig(),
    "big": ModelConfig(  # residual dropout 0.3 (Table 3); the paper drops no attention weights
        d_model=1024, n_heads=16, d_ff=4096, dropout=0.3, attention_dropout=0.0,
    ),
}

TRAIN_PRESETS: dict[str, TrainConfig] = {
    "tiny": TrainConfig(vocab_size=200, max_tokens=1024, warmup_steps=100, max_steps=200, eval_every=100, label_smoothing=0.1),
    "small": TrainConfig(vocab_size=8000, max_tokens=4096, warmup_steps=4000),
    "base": TrainConfig(vocab_size=37000, max_tokens=25000, update_tokens=25000, warmup_steps=4000),
    # the big model as the paper trains it: no gradient clipping, the last 20 checkpoints kept to average
    "big": TrainConfig(vocab_size=37000, max_tokens=25000, update_tokens=25000, warmup_steps=4000, max_steps=300_000,
                       clip_norm=0.0, keep_last=20),
}


def per_process_batch(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` with ``max_tokens`` the per-batch share of ``update_tokens`` for ``world_size`` processes,
    each accumulating ``update_freq`` batches: ``update_tokens // (world_size * update_freq)`` (25,000
    on 8 processes: 3,125 each); ``cfg`` itself when ``update_tokens`` is 0."""
    if not cfg.update_tokens:
        return cfg
    share = cfg.update_tokens // (world_size * cfg.update_freq)
    _check(share >= cfg.max_len + 2, "update_tokens",
           f"{cfg.update_tokens} over {world_size} process(es) x update_freq {cfg.update_freq} leaves {share} tokens "
           f"a batch, fewer than one sentence of max_len={cfg.max_len} (+2)")
    return replace(cfg, max_tokens=share)

PRESETS = tuple(MODEL_PRESETS)
# what `qkv train` on given data and `qkv info` use without --preset or a config naming one
DEFAULT_PRESET = "small"


def preset(name: str) -> tuple[ModelConfig, TrainConfig]:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; choose one of {', '.join(PRESETS)}")
    return MODEL_PRESETS[name], TRAIN_PRESETS[name]


def check_option_bounds(seed: int | None = None, threads: int = 0, **floats: float) -> None:
    """The bounds TrainConfig.validate sets, for commands that take --seed, --threads or float
    options as plain flags: torch overflows on a seed beyond 64 bits and crashes on thousands of
    threads; inf and nan are refused by name."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2**63 - 1], got {seed}")
    if not 0 <= threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be in [0, {MAX_THREADS}] (0: torch's default), got {threads}")
    for name, value in floats.items():
        if not math.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


# --- layering: preset < config file < flags, and what a resumed run may change ---------------------

# TrainConfig fields a resumed run may change: limits, evaluation cadence, hardware. Everything else
# (the model, the data, the optimisation) continues as the run was started; the search may change.
# update_freq may change only so that an update keeps its size, update_freq x processes, when the
# number of processes changes (Trainer.restore checks it: the run's own process count is in its state).
RESUMABLE = frozenset({"max_steps", "max_epochs", "max_time", "patience", "lr_shrink", "max_lr_shrinks",
                       "eval_every", "first_eval", "eval_bleu_samples", "keep_last", "threads", "device", "amp", "compile",
                       "fused_loss", "nonfinite_limit", "update_freq"})
SECTIONS = ("model", "train", "decode")

# The field that sets each schedule's rate. A layer that changes the schedule without setting the new
# schedule's rate field returns the old schedule's field to its default: a preset's or recipe's lr_scale
# belongs to its noam schedule and does not follow a file or flag to constant (and lr does not follow to noam).
SCHEDULE_RATE = {"noam": "lr_scale", "constant": "lr", "inverse_sqrt": "lr"}
# What a recurrent model (arch rnn | lstm | gru) changes in a preset's training settings when no file or
# flag chooses a schedule (schedule or lr_scale): Adam at a constant rate, lr 0 meaning DEFAULT_LR (1e-3),
# instead of the Transformer's warmup, which would start it at ~1e-7 and take thousands of updates to rise.
RECURRENT_SCHEDULE: dict[str, Any] = {"schedule": "constant", "lr": 0.0}


def layered(base: tuple[ModelConfig, TrainConfig, DecodeConfig], file: dict[str, Any], file_src: str,
            flags: dict[str, dict[str, Any]], resumed: bool = False,
            recurrent: dict[str, Any] = RECURRENT_SCHEDULE) -> tuple[ModelConfig, TrainConfig, DecodeConfig]:
    """``base`` (a preset's configs, or a resumed run's) overridden by a config ``file``'s sections,
    then by command-line ``flags`` ({"model": {...}, "train": {...}, "decode": {...}}), validated.

    When the layers make the model recurrent and none of them chooses a schedule (``schedule`` or
    ``lr_scale``), the base's training settings first take ``recurrent`` (:data:`RECURRENT_SCHEDULE`;
    a recipe passes its own), so a recurrent model never inherits a Transformer's warmup.

    ``resumed``: the run continues as configured, so a file or flag that changes a model setting, or
    a train setting outside :data:`RESUMABLE`, is refused by name (equal values are allowed)."""
    layers = [(file.get(s, {}) for s in SECTIONS), (flags.get(s, {}) for s in SECTIONS)]
    out = list(base)
    if not resumed:
        model = override(override(base[0], file.get("model", {}), file_src), flags.get("model", {}), "flags")
        chosen = {k for section in (file.get("train", {}), flags.get("train", {})) for k in section}
        if model.is_recurrent and not chosen & {"schedule", "lr_scale"}:
            out[1] = override(base[1], recurrent, "the recurrent models' schedule")
    for (model, train, decode), source in zip(layers, (file_src, "flags")):
        if resumed:
            name = (lambda sec, k: "--" + k.replace("_", "-")) if source == "flags" else (lambda sec, k: f"[{sec}] {k}")
            fixed = [name("model", k) for k, v in model.items() if hasattr(out[0], k) and v != getattr(out[0], k)]
            fixed += [name("train", k) for k, v in train.items()
                      if k not in RESUMABLE and hasattr(out[1], k) and v != getattr(out[1], k)]
            if fixed:
                raise ConfigError(f"--resume continues the run as configured; {source} may not change "
                                  f"{', '.join(sorted(fixed))}: these settings cannot change now (only "
                                  f"{', '.join(sorted(RESUMABLE))} can)")
        out = [override(cfg, data, source) for cfg, data in zip(out, (model, train, decode))]
    model_cfg, train_cfg, decode_cfg = out
    return model_cfg.validate(), train_cfg.validate(), decode_cfg.validate()


# --- files and overrides ---------------------------------------------------------------------------

def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any], source: str = "config") -> Any:
    """Build ``cls`` from a dict, rejecting unknown keys and mistyped values by name."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)} for [{_section_of(cls)}]")
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(known[key], value, source)
    return cls(**kwargs)


def override(cfg: Any, data: dict[str, Any], source: str = "config") -> Any:
    """``dataclasses.replace`` with type checks and a clear error for unknown fields."""
    if not data:
        return cfg
    known = {f.name: f for f in fields(cfg)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)} for [{_section_of(type(cfg))}]")
    values = {k: _coerce(known[k], v, source) for k, v in data.items()}
    if isinstance(cfg, TrainConfig) and values.get("schedule", cfg.schedule) != cfg.schedule:
        old, new = SCHEDULE_RATE.get(cfg.schedule), SCHEDULE_RATE.get(values["schedule"])
        if old and old != new and old not in values:  # the old schedule's rate does not carry to the new one
            values[old] = known[old].default
    return dataclasses.replace(cfg, **values)


def _section_of(cls: type) -> str:
    return {ModelConfig: "model", TrainConfig: "train", DecodeConfig: "decode"}.get(cls, cls.__name__)


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: field '{f.name}' must be of type {kind}, got {value!r}") from None
    return value


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a config file with optional ``[model]``, ``[train]``, ``[decode]`` tables and ``preset``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid UTF-8: {e}") from None
    allowed = {"preset", "model", "train", "decode"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{p}: unknown section(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    for name in ("model", "train", "decode"):
        if name in data and not isinstance(data[name], dict):
            raise ConfigError(f"{p}: '{name}' must be a table ([{name}]), got {data[name]!r}")
    if "preset" in data and not isinstance(data["preset"], str):
        raise ConfigError(f"{p}: 'preset' must be a string, got {data['preset']!r}")
    return data

"""Recurrent encoder–decoders: the sequence-to-sequence models the Transformer replaced.

Encoder (Sutskever et al., 2014; Bahdanau et al., 2015): an RNN/LSTM/GRU stack, optionally
bidirectional, reads the source (packed, so padding never enters a state):

    h̄_1..h̄_S = Encoder(Embedding(x))                     (B, S, H·dirs)  -> memory (B, S, H)

Decoder: an RNN/LSTM/GRU stack whose initial state is the encoder's final state through a bridge,
s_0 = tanh(W_b [h→_S; h←_1] + b_b), and which reads the target shifted right. On top of its state
h_t sits the attentional layer of Luong et al. (2015):

    c_t = Σ_s a_t(s) h̄_s,  a_t = softmax_s score(h_t, h̄_s)     (attention, any score of qkv.nn.scores)
    h̃_t = tanh(W_c [c_t; h_t])
    p(y_t | y_<t, x) = softmax(W_s h̃_t)                          (W_s tied to the target embedding)

With ``attention = "none"`` the model is the context-vector encoder–decoder of Cho et al. (2014):
c_t = c = the last encoder state for every t, fed to every decoder step (the decoder input is
[E y_{t−1}; c]) as well as initialising the decoder (Sutskever et al.) — the whole source
squeezed through one fixed-size vector. With ``input_feeding`` (Luong et al., 2015, section 3.3)
the decoder input is [E y_{t−1}; h̃_{t−1}], so past alignment decisions inform the next; without
it the decoder RNN runs over the whole target at once in training (the fast path).

The interface is the Transformer's: ``forward(src, tgt_in) -> logits``, ``start(src) -> state``,
``step(tokens, state) -> (logits, state)`` with ``state.reorder(indices)``, so greedy search,
beam search, the trainer, checkpoints and the CLI work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import PAD, ModelConfig
from qkv.masks import padding_mask
from qkv.nn.recurrent import Recurrent, RNNState, final_states
from qkv.nn.scores import attend, build_score


@dataclass
class RNNSeq2SeqState:
    """Incremental decoding state: the decoder RNN's state plus what the attention reads, computed once."""

    rnn: RNNState  # decoder state, (layers, B, H)
    memory: Tensor  # (B, S, H) encoder states h̄_s (the attention's values)
    keys: Tensor  # (B, S, ·) score.keys(memory), computed once per sentence
    mask: Tensor  # (B, 1, S) True on real source tokens
    context: Tensor | None  # (B, H) the fixed context vector (attention "none")
    feed: Tensor | None  # (B, H) h̃_{t−1} (input feeding)

    def reorder(self, indices: Tensor) -> "RNNSeq2SeqState":
        """Select/reorder batch rows (beam back-pointers, dropping finished sentences)."""
        pick = (lambda t: None if t is None else t.index_select(0, indices))
        return RNNSeq2SeqState(self.rnn.reorder(indices), pick(self.memory), pick(self.keys), pick(self.mask),
                               pick(self.context), pick(self.feed))


@dataclass
class Encoded:
    memory: Tensor  # (B, S, H)
    keys: Tensor
    mask: Tensor  # (B, 1, S)
    context: Tensor | None  # (B, H)
    init: RNNState  # the decoder's initial state


class RNNSeq2Seq(nn.Module):
    """RNN / LSTM / GRU encoder–decoder (``cfg.arch``), with or without attention (``cfg.attention``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.arch not in ("rnn", "lstm", "gru"):
            raise ValueError(f"RNNSeq2Seq is the recurrent model; arch {cfg.arch!r} is not rnn, lstm or gru")
        if cfg.src_vocab_size <= 0 or cfg.tgt_vocab_size <= 0:
            raise ValueError("ModelConfig.src_vocab_size and tgt_vocab_size must be set (from the tokenizer)")
        self.cfg = cfg
        d, kind = cfg.d_model, cfg.arch
        self.src_embed = nn.Embedding(cfg.src_vocab_size, d, padding_idx=PAD)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab_size, d, padding_idx=PAD)
        self.encoder = Recurrent(kind, d, d, cfg.n_encoder_layers, cfg.bidirectional, cfg.dropout, cfg.rnn_nonlinearity)
        dirs = self.encoder.num_directions
        # [h→; h←] (2H) -> H: the memory the decoder attends to, and the bridge to its initial state
        self.memory_proj = nn.Linear(dirs * d, d, bias=False) if dirs > 1 else nn.Identity()
        self.bridge_h = nn.Linear(dirs * d, d)
        self.bridge_c = nn.Linear(dirs * d, d) if kind == "lstm" else None
        self.has_attention = cfg.attention != "none"
        extra_input = d if (not self.has_attention or cfg.input_feeding) else 0  # c (Cho) or h̃_{t−1} (feeding)
        self.decoder = Recurrent(kind, d + extra_input, d, cfg.n_decoder_layers, False, cfg.dropout,
                                 cfg.rnn_nonlinearity)
        self.score = build_score(cfg.attention, d, d, cfg.max_positions) if self.has_attention else None
        self.combine = nn.Linear(2 * d, d, bias=False)  # W_c of h̃_t = tanh(W_c [c_t; h_t])
        self.output_proj = None if cfg.tie_output else nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Uniform(−0.1, 0.1) for the recurrent and linear weights (Sutskever et al. use ±0.08; OpenNMT
        ±0.1); N(0, 1) for the embeddings (torch's default), padding row 0. The cosine score keeps its
        own initial key strength.

        The embeddings are not drawn from ±0.1: with the output tied to them, logits h̃·e start so
        small (|h̃| < 1) that a tiny model sat on the uniform-over-words plateau of a word-reversal
        task for hundreds of updates, where N(0, 1) embeddings learn it in about fifty (measured
        with tests/test_rnn_cli.py's task)."""
        for name, p in self.named_parameters():
            if name.startswith(("src_embed", "tgt_embed")):
                nn.init.normal_(p, 0.0, 1.0)
            elif not name.startswith("score.beta"):
                nn.init.uniform_(p, -0.1, 0.1)
        with torch.no_grad():
            self.src_embed.weight[PAD].zero_()
            self.tgt_embed.weight[PAD].zero_()

    # --- pieces --------------------------------------------------------------------------------------

    def _dropout(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.cfg.dropout, self.training)

    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection ``(V, H)``: the target embedding when tied (what the fused loss reads)."""
        return self.tgt_embed.weight if self.output_proj is None else self.output_proj.weight

    def _logits(self, h_tilde: Tensor, features: bool = False) -> Tensor:
        x = self._dropout(h_tilde)
        return x if features else F.linear(x, self.output_weight)  # (B, T, V), or (B, T, H) with features

    def encode(self, src: Tensor) -> Encoded:
        """``src (B, S)`` -> memory, attention keys, mask, context vector and the decoder's initial state."""
        mask = padding_mask(src)[:, 0]  # (B, 1, S)
        lengths = mask[:, 0].sum(dim=1)  # (B,)
        out, final = self.encoder(self._dropout(self.src_embed(src)), lengths.clamp_min(1))  # (B, S, H·dirs)
        memory = self.memory_proj(out)  # (B, S, H)
        enc, dec = self.encoder, self.decoder
        # decoder layer l starts from encoder layer l when the stacks match, else from the top layer
        layers = range(dec.num_layers) if enc.num_layers == dec.num_layers else [-1] * dec.num_layers
        h = torch.stack([final_states(final, enc.num_layers, enc.num_directions, l) for l in layers])  # (L, B, H·dirs)
        init = RNNState(torch.tanh(self.bridge_h(h)))
        if self.bridge_c is not None:
            c = torch.stack([final_states(RNNState(final.c), enc.num_layers, enc.num_directions, l) for l in layers])
            init = RNNState(init.h, self.bridge_c(c))
        context = None
        if not self.has_attention:  # the last encoder state [h→_S; h←_1] of the top layer, as the memory
            context = self.memory_proj(final_states(final, enc.num_layers, enc.num_directions))  # (B, H)
        keys = self.score.keys(memory) if self.score is not None else memory
        return Encoded(memory, keys, mask, context, init)

    def _attentional(self, h: Tensor, memory: Tensor, keys: Tensor, mask: Tensor,
                     context: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Decoder states ``h (B, T, H)`` -> h̃ ``(B, T, H)`` and the alignment ``(B, T, S)`` (None without attention)."""
        if self.score is None:
            c, a = context[:, None, :].expand_as(h), None  # (B, T, H)
        else:
            c, a = attend(self.score, h, keys, memory, mask)  # (B, T, H), (B, T, S)
        return torch.tanh(self.combine(torch.cat([c, h], dim=-1))), a

    def _decode(self, tgt_in: Tensor, enc: Encoded, need_weights: bool = False,
                features: bool = False) -> tuple[Tensor, Tensor | None]:
        """Teacher forcing: ``tgt_in (B, T)`` -> logits ``(B, T, V)`` (and the alignment ``(B, T, S)``);
        with ``features``, the (dropped-out) h̃ ``(B, T, H)`` that the output projection would take."""
        if self.score is not None and self.cfg.input_feeding:  # sequential: h̃_{t−1} feeds step t
            state = self._state(enc)
            h_tildes, weights = [], []
            for t in range(tgt_in.size(1)):
                h_tilde, state, a = self._attend_step(tgt_in[:, t], state)
                h_tildes.append(h_tilde)
                weights.append(a)
            return self._logits(torch.cat(h_tildes, 1), features), (torch.cat(weights, 1) if need_weights else None)
        x = self._dropout(self.tgt_embed(tgt_in))  # (B, T, H)
        if enc.context is not None:
            x = torch.cat([x, enc.context[:, None, :].expand_as(x)], dim=-1)  # (B, T, 2H)
        h, _ = self.decoder(x, None, enc.init)  # (B, T, H)
        h_tilde, a = self._attentional(h, enc.memory, enc.keys, enc.mask, enc.context)
        return self._logits(h_tilde, features), a

    def forward(self, src: Tensor, tgt_in: Tensor, features: bool = False) -> Tensor:
        """``src (B, S)``, ``tgt_in (B, T)`` -> logits ``(B, T, V)``; with ``features`` the states ``(B, T, H)``
        before the output projection (``output_weight``), for the fused loss."""
        return self._decode(tgt_in, self.encode(src), features=features)[0]

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """The alignment matrix ``(B, T, S)`` a_t(s) of the teacher-forced forward pass (for the visualiser).
        Rows sum to 1 over the real source tokens. A context-vector model (``attention = "none"``) has none."""
        if self.score is None:
            raise ValueError("this model has no attention (attention = 'none'): the decoder sees the source "
                             "only through the last encoder state, the context vector")
        return self._decode(tgt_in, self.encode(src), need_weights=True)[1]

    # --- incremental decoding ------------------------------------------------------------------------

    def _state(self, enc: Encoded) -> RNNSeq2SeqState:
        feed = enc.memory.new_zeros(enc.memory.size(0), self.cfg.d_model) if self.cfg.input_feeding else None
        return RNNSeq2SeqState(enc.init, enc.memory, enc.keys, enc.mask, enc.context, feed)

    def start(self, src: Tensor) -> RNNSeq2SeqState:
        """Encode ``src (B, S)``; the attention keys are computed here, once per sentence."""
        return self._state(self.encode(src))

    def _attend_step(self, tokens: Tensor, state: RNNSeq2SeqState) -> tuple[Tensor, RNNSeq2SeqState, Tensor | None]:
        """One step of the decoder: h̃ ``(B, 1, H)``, the new state and the alignment ``(B, 1, S)``."""
        x = self._dropout(self.tgt_embed(tokens[:, None]))  # (B, 1, H)
        extra = state.context if state.context is not None else state.feed
        if extra is not None:
            x = torch.cat([x, extra[:, None, :]], dim=-1)  # (B, 1, 2H)
        h, rnn = self.decoder(x, None, state.rnn)  # (B, 1, H)
        h_tilde, a = self._attentional(h, state.memory, state.keys, state.mask, state.context)
        feed = h_tilde[:, 0] if state.feed is not None else None
        return h_tilde, RNNSeq2SeqState(rnn, state.memory, state.keys, state.mask, state.context, feed), a

    def _step(self, tokens: Tensor, state: RNNSeq2SeqState) -> tuple[Tensor, RNNSeq2SeqState, Tensor | None]:
        h_tilde, new, a = self._attend_step(tokens, state)
        return self._logits(h_tilde)[:, 0], new, a

    def max_source_len(self) -> int | None:
        """The longest ``src`` row (EOS included) :meth:`start` reads: location-based attention has a
        weight row per source position, ``max_positions`` of them; any length otherwise (None)."""
        return self.cfg.max_positions if self.cfg.attention == "location" else None

    def max_steps(self, src_lengths: Tensor) -> None:
        """A recurrent decoder steps on without limit."""
        return None

    def step(self, tokens: Tensor, state: RNNSeq2SeqState) -> tuple[Tensor, RNNSeq2SeqState]:
        """One decoding step: the last tokens ``(B,)`` -> next-token logits ``(B, V)``."""
        logits, state, _ = self._step(tokens, state)
        return logits, state


__all__ = ["RNNSeq2Seq", "RNNSeq2SeqState"]

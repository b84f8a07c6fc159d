"""The recurrent language model (Mikolov et al., 2010; Zaremba et al., 2014): RNN, LSTM or GRU.

    e_t = E x_t                                  (embedding, dropout)
    h_t, s_t = Recurrent(e_t, s_{t-1})           (N stacked layers, dropout between them)
    p(x_{t+1} | x_<=t) = softmax(W · Dropout(h_t))   (W tied to E when ``tie_output``; Press & Wolf, 2017)

Training runs truncated backpropagation through time (:mod:`qkv.bptt`): the state
after one window is the (detached) initial state of the next, so the model sees the whole
stream while gradients flow through ``bptt`` steps only.

Decoding uses the interface of every qkv decoder: :meth:`RNNLanguageModel.start` runs a
prefix ``(B, P)`` (right-padded with PAD) and returns the :class:`RNNState` after each row's
last real token; :meth:`RNNLanguageModel.step` feeds one token per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import PAD, ModelConfig
from qkv.masks import real_tokens
from qkv.nn.recurrent import Recurrent, RNNState


class RNNLanguageModel(nn.Module):
    """``cfg.arch`` in rnn | lstm | gru; embedding and hidden size ``cfg.d_model``;
    ``cfg.n_decoder_layers`` layers; vocabulary ``cfg.tgt_vocab_size``."""

    def __init__(self, cfg: ModelConfig, kind: str | None = None):
        super().__init__()
        kind = kind or cfg.arch
        if cfg.tgt_vocab_size <= 0:
            raise ValueError("ModelConfig.tgt_vocab_size must be set (from the tokenizer)")
        self.cfg, self.kind = cfg, kind
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.tgt_vocab_size, d, padding_idx=PAD)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.rnn = Recurrent(kind, d, d, num_layers=cfg.n_decoder_layers, dropout=cfg.dropout,
                             nonlinearity=getattr(cfg, "rnn_nonlinearity", "tanh"))
        self.output_proj = None if cfg.tie_output else nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        self.output_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = F.dropout(h, self.cfg.dropout, self.training)
        w = self.embed.weight if self.output_proj is None else self.output_proj.weight
        return F.linear(h, w, self.output_bias)  # (B, T, V)

    def forward(self, tokens: torch.Tensor, state: RNNState | None = None) -> tuple[torch.Tensor, RNNState]:
        """``tokens (B, T)`` from ``state`` (zeros when None) -> next-token logits ``(B, T, V)`` and
        the state after the last position (padding, if any, must trail and its outputs be ignored)."""
        x = F.dropout(self.embed(tokens), self.cfg.dropout, self.training)  # (B, T, d)
        out, state = self.rnn(x, state=state)  # (B, T, d)
        return self._logits(out), state

    def initial_state(self, batch_size: int) -> RNNState:
        return self.rnn.initial_state(batch_size, self.embed.weight)

    def start(self, prefix: torch.Tensor) -> RNNState:
        """Run ``prefix (B, P)`` (right-padded; P may be 0): the state after each row's last real token."""
        b = prefix.size(0)
        state = self.initial_state(b)
        lengths = real_tokens(prefix).sum(dim=1)  # (B,)
        if prefix.size(1) == 0 or not bool(lengths.any()):
            return state
        x = self.embed(prefix)  # (B, P, d)
        _, final = self.rnn(x, lengths=lengths.clamp(min=1), state=state)  # packed: stops at each length
        empty = (lengths == 0)[None, :, None]  # (1, B, 1): rows with no prefix keep the zero state
        h = torch.where(empty, state.h, final.h)
        c = None if final.c is None else torch.where(empty, state.c, final.c)
        return RNNState(h, c)

    def max_source_len(self) -> None:
        """A recurrent model reads prefixes of any length."""
        return None

    def max_steps(self, src_lengths: torch.Tensor) -> None:
        """A recurrent model steps on without limit."""
        return None

    def step(self, tokens: torch.Tensor, state: RNNState) -> tuple[torch.Tensor, RNNState]:
        """Feed one token per row ``(B,)`` -> next-token logits ``(B, V)`` and the new state."""
        logits, state = self(tokens[:, None], state)
        return logits[:, 0], state

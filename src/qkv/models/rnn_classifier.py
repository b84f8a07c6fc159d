"""A recurrent classifier (seq2vec): the (Bi)LSTM / (Bi)GRU / RNN text classifier.

    h_1 .. h_T = Recurrent(Dropout(Embedding(x)))                    (B, T, H·dirs), zero at padding
    pooling "mean": h = Σ_t m_t h_t / Σ_t m_t,  m_t = [t < length]   (over valid positions only)
    pooling "last": h = [h→_{length}; h←_1]                          the forward state at each
                    sequence's true end and the backward state at its first position, i.e. the
                    final states of both directions (for one direction: h→_{length})
    logits = W_c · Dropout(h) + b_c                                   (B, C)

The input has the layout of the encoder tasks (``<cls> x_1 .. x_n``, PAD on the right); the
``<cls>`` piece is an ordinary first token here. Sequences run packed (:class:`qkv.nn.recurrent.Recurrent`),
so padding never enters a state: adding padding does not change the output.
``d_model`` is the embedding and hidden size, ``n_encoder_layers`` the stacked layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import PAD, ModelConfig
from qkv.masks import real_tokens
from qkv.models.encoder_only import mean_pool
from qkv.nn.recurrent import Recurrent


class RNNClassifier(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.src_vocab_size <= 0:
            raise ValueError("ModelConfig.src_vocab_size must be set (from the tokenizer)")
        if cfg.n_classes < 2:
            raise ValueError("ModelConfig.n_classes must be set (from the training labels)")
        self.cfg = cfg
        d = cfg.d_model
        self.src_embed = nn.Embedding(cfg.src_vocab_size, d, padding_idx=PAD)
        self.encoder = Recurrent(cfg.arch, d, d, cfg.n_encoder_layers, cfg.bidirectional, cfg.dropout,
                                 cfg.rnn_nonlinearity)
        self.directions = 2 if cfg.bidirectional else 1
        self.classifier = nn.Linear(d * self.directions, cfg.n_classes)

    def encode(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens (B, T)`` -> outputs ``(B, T, H·dirs)`` (zero at padding) and lengths ``(B,)``."""
        lengths = real_tokens(tokens).sum(dim=1).clamp_min(1)  # (B,)
        x = F.dropout(self.src_embed(tokens), self.cfg.dropout, self.training)  # (B, T, d)
        out, _ = self.encoder(x, lengths)
        return out, lengths

    def pool(self, out: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
             pooling: str | None = None) -> torch.Tensor:
        pooling = pooling or self.cfg.pooling
        if pooling == "mean":
            return mean_pool(out, real_tokens(tokens))  # (B, H·dirs)
        if pooling == "last":
            b = torch.arange(out.size(0), device=out.device)
            h = self.cfg.d_model
            forward = out[b, lengths - 1, :h]  # (B, H): the forward state at each true end
            if self.directions == 1:
                return forward
            return torch.cat([forward, out[:, 0, h:]], dim=-1)  # (B, 2H): + the backward state at t = 1
        raise ValueError(f"a recurrent classifier pools 'mean' or 'last', not {pooling!r}")

    def embed(self, tokens: torch.Tensor, pooling: str | None = None) -> torch.Tensor:
        """Sentence embeddings ``(B, H·dirs)``; "cls" pooling means the model's own here."""
        out, lengths = self.encode(tokens)
        return self.pool(out, tokens, lengths, None if pooling == "cls" else pooling)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens (B, T)`` -> class logits ``(B, C)``."""
        out, lengths = self.encode(tokens)
        pooled = self.pool(out, tokens, lengths)
        return self.classifier(F.dropout(pooled, self.cfg.dropout, self.training))  # (B, C)

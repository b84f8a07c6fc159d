"""The Transformer encoder alone (seq2vec): classification and masked language modelling.

The left half of Figure 1 with a head on top (as BERT, Devlin et al., 2019):

    tokens = <cls> x_1 .. x_n  -> Embedding·√d_model + PE -> Dropout -> N × EncoderLayer = H  (B, T, d)

    pooling "cls":  h = H[:, 0]                                       (the <cls> position)
    pooling "mean": h = Σ_t m_t H[:, t] / Σ_t m_t,  m_t = [token t is not PAD]
    classification: logits = W_c · Dropout(h) + b_c                  (B, C)
                    (with ``pooler``, BERT's: h -> tanh(W_p h + b_p) first)
    MLM:            logits = LayerNorm(GELU(W_m H + b_m)) Eᵀ + b_v    (B, T, V), E the tied embedding

Padding is masked in self-attention (:func:`qkv.masks.padding_mask`) and in the mean, so
adding padding to a batch does not change any example's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.masks import padding_mask, real_tokens
from qkv.nn.embedding import ScaledEmbedding
from qkv.nn.layers import EncoderLayer
from qkv.nn.feed_forward import ACTIVATIONS
from qkv.nn.stack import TransformerStack, embedding_width, input_modules, projection_module, stack_modules


def mean_pool(h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``h (B, T, d)``, ``valid (B, T)`` bool -> the mean over valid positions ``(B, d)``."""
    w = valid.to(h.dtype)[:, :, None]  # (B, T, 1)
    return (h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)  # (B, d)


class MLMHead(nn.Module):
    """``LayerNorm(GELU(W H + b)) Eᵀ + b_v``: the output projection is the (tied) embedding matrix.

    ``W`` maps d_model to the embeddings' width (narrower with ``embedding_dim``: ALBERT's head);
    ``activation`` (``ModelConfig.mlm_head_activation``) replaces GELU (ALBERT's tanh approximation)."""

    def __init__(self, d_model: int, embed: ScaledEmbedding, eps: float = 1e-5, activation: str = "gelu"):
        super().__init__()
        width = embed.weight.size(1)
        self.dense = nn.Linear(d_model, width)
        self.norm = nn.LayerNorm(width, eps=eps)
        self.embed = embed  # shared, not a copy
        self.bias = nn.Parameter(torch.zeros(embed.weight.size(0)))
        self.act = ACTIVATIONS[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.embed.logits(self.norm(self.act(self.dense(h)))) + self.bias  # (B, T, V)


POOLER_FUNCTIONS = {"tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu}


class EncoderOnly(nn.Module):
    """Encoder + head; ``cfg.task`` picks the head: ``classify`` (n_classes) or ``mlm`` (vocabulary)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.src_vocab_size <= 0:
            raise ValueError("ModelConfig.src_vocab_size must be set (from the tokenizer)")
        if cfg.task == "classify" and cfg.n_classes < 2:
            raise ValueError("ModelConfig.n_classes must be set (from the training labels)")
        self.cfg = cfg
        d = cfg.d_model
        self.src_embed = ScaledEmbedding(cfg.src_vocab_size, embedding_width(cfg), scale=cfg.scale_embeddings)
        self.src_pos, self.encoder_layers, self.encoder_norm = stack_modules(cfg, cfg.n_encoder_layers, EncoderLayer)
        self.src_types, self.embed_norm = input_modules(cfg)  # None, None for the paper's model
        if cfg.embedding_dim:  # ALBERT's, ELECTRA's: the embeddings' map to d_model (registered after the rest)
            self.embed_proj = projection_module(cfg)
        if cfg.task == "classify":
            if cfg.pooler:  # BERT's: tanh(W h + b)
                self.pooler = nn.Linear(d, d)
            self.classifier = nn.Linear(d, cfg.n_classes)
        elif cfg.mlm_head:
            self.mlm_head = MLMHead(d, self.src_embed, cfg.layer_norm_eps, cfg.mlm_head_activation)

    @property
    def encoder(self) -> TransformerStack:
        """The encoder: token embedding, positions, N encoder layers."""
        return TransformerStack(self.src_embed, self.src_pos, self.encoder_layers, self.encoder_norm, self.cfg.dropout,
                                self.src_types, self.embed_norm, getattr(self, "embed_proj", None))

    def encode(self, tokens: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor, list]:
        """``tokens (B, T)`` -> states ``H (B, T, d)``, padding mask ``(B, 1, 1, T)``, attention weights."""
        mask = padding_mask(tokens)  # (B, 1, 1, T)
        h, _, weights = self.encoder(tokens, mask=mask, need_weights=need_weights)
        return h, mask, weights

    def attention_maps(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's self-attention weights ``(B, h, T, T)`` from one forward pass of the
        encoder (for the visualiser): returned by the layers when asked, nothing is stored.
        Row i sums to 1 over the non-PAD keys; PAD keys get weight 0."""
        _, _, weights = self.encode(tokens, need_weights=True)
        return weights

    def pool(self, h: torch.Tensor, tokens: torch.Tensor, pooling: str | None = None) -> torch.Tensor:
        """One vector per sequence ``(B, d)``: the ``<cls>`` state or the mean over non-PAD positions."""
        pooling = pooling or self.cfg.pooling
        if pooling == "cls":
            return h[:, 0]  # (B, d): the <cls> token, always first
        if pooling == "mean":
            return mean_pool(h, real_tokens(tokens))
        raise ValueError(f"an encoder pools 'cls' or 'mean', not {pooling!r}")

    def embed(self, tokens: torch.Tensor, pooling: str | None = None) -> torch.Tensor:
        """Sentence embeddings ``(B, d)`` (for ``qkv embed`` / ``qkv search``)."""
        h, _, _ = self.encode(tokens)
        return self.pool(h, tokens, pooling)

    def forward(self, tokens: torch.Tensor, predict: torch.Tensor | None = None) -> torch.Tensor:
        """classify: ``(B, T)`` -> class logits ``(B, C)``; mlm: -> token logits ``(B, T, V)``, or
        ``(N, V)`` at the N positions where ``predict (B, T)`` is True (the chosen ones: cheaper)."""
        h, _, _ = self.encode(tokens)
        if self.cfg.task == "classify":
            pooled = self.pool(h, tokens)
            if self.cfg.pooler:  # BERT's tanh(W h + b); RoBERTa's and ELECTRA's heads drop out h first
                if self.cfg.pooler_dropout:
                    pooled = F.dropout(pooled, self.cfg.dropout, self.training)
                pooled = POOLER_FUNCTIONS[self.cfg.pooler_activation](self.pooler(pooled))
            return self.classifier(F.dropout(pooled, self.cfg.dropout, self.training))  # (B, C)
        if not self.cfg.mlm_head:
            raise QkvError("this encoder has no masked-LM head (imported without one): it embeds, it does not fill")
        if predict is not None:
            h = h[predict]  # (N, d)
        return self.mlm_head(h)  # (B, T, V) or (N, V)

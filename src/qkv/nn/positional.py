"""Positional encodings (section 3.5).

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

"each dimension of the positional encoding corresponds to a sinusoid. The wavelengths form a
geometric progression from 2π to 10000·2π." The paper also tried learned positional embeddings
and found nearly identical results (Table 3, row E): ``LearnedPositionalEncoding``. ``"none"``
(``NoPositionalEncoding``) adds nothing: without positions self-attention cannot tell one order of
its input from another (it is permutation-equivariant), the lesson of section 3.5.
"""

from __future__ import annotations


import torch
from torch import nn


def sinusoidal_table(n_positions: int, d_model: int, layout: str = "interleaved") -> torch.Tensor:
    """The ``(n_positions, d_model)`` table PE above (d_model even). ``layout="halves"``: the same
    sinusoids with the sines in the first d/2 dimensions and the cosines in the second
    (``PE[:, i] = sin(pos / 10000^(2i/d))``, ``PE[:, d/2 + i] = cos(...)``), as Marian's models have them."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, d/2)
    pe = torch.empty(n_positions, d_model, dtype=torch.float64)
    if layout == "halves":
        pe[:, : d_model // 2] = torch.sin(angle)
        pe[:, d_model // 2:] = torch.cos(angle)
    else:
        pe[:, 0::2] = torch.sin(angle)
        pe[:, 1::2] = torch.cos(angle)
    return pe.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Adds nothing learnable: a fixed table, extended on the fly for longer inputs."""

    def __init__(self, d_model: int, max_positions: int = 1024, layout: str = "interleaved"):
        super().__init__()
        self.d_model, self.layout = d_model, layout
        self.register_buffer("table", sinusoidal_table(max_positions, d_model, layout), persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        """Encodings of positions ``offset .. offset + length - 1``, ``(1, length, d_model)``."""
        end = offset + length
        if end > self.table.size(0):  # longer than ever seen: grow the table (no limit by design)
            self.table = sinusoidal_table(max(end, 2 * self.table.size(0)), self.d_model, self.layout).to(self.table.device)
        return self.table[offset:end][None]  # (1, T, d_model)


class LearnedPositionalEncoding(nn.Module):
    """One learned vector per position, up to ``max_positions``.

    ``offset``: rows of the table before position 0 (RoBERTa's and BART's 2, their padding_idx + 1 and
    a start of 2): the table has ``max_positions + offset`` rows and position t reads row ``t + offset``."""

    def __init__(self, d_model: int, max_positions: int = 1024, offset: int = 0):
        super().__init__()
        self.max_positions, self.offset = max_positions, offset
        self.weight = nn.Parameter(torch.randn(max_positions + offset, d_model) * d_model**-0.5)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        end = offset + length
        if end > self.max_positions:
            raise ValueError(
                f"sequence of {end} positions is longer than the learned positional table "
                f"(max_positions={self.max_positions})"
            )
        return self.weight[self.offset + offset:self.offset + end][None]  # (1, T, d_model)


class NoPositionalEncoding(nn.Module):
    """No positions: zeros, so a Transformer sees its input as a bag of tokens."""

    def __init__(self, d_model: int, max_positions: int = 1024):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("anchor", torch.zeros(0), persistent=False)  # follows the model's device and dtype

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        return self.anchor.new_zeros(1, length, self.d_model)


def stack_positions(cfg, causal: bool = False) -> nn.Module:
    """The positional module of a Transformer stack of ``cfg`` (a :class:`~qkv.config.ModelConfig`):
    a table added to the embeddings, or rotary / relative positions applied inside attention
    (:mod:`qkv.nn.rotary`, :mod:`qkv.nn.relative`; ``causal``: a decoder's relative buckets)."""
    if cfg.positional == "rotary":
        from qkv.nn.rotary import RotaryPositions

        return RotaryPositions(cfg.d_model, cfg.d_k, cfg.rope_theta)
    if cfg.positional == "relative":
        from qkv.nn.relative import RelativePositions

        return RelativePositions(cfg.d_model, cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance,
                                 bidirectional=not causal)
    # a table is as wide as the embeddings it is added to (embedding_dim: ALBERT's E, projected to d_model
    # after), and learned positions may start at a row other than the first (position_offset)
    return positional_encoding(cfg.positional, cfg.embedding_dim or cfg.d_model, cfg.max_positions,
                               cfg.sinusoid_layout, cfg.position_offset)


def positional_encoding(kind: str, d_model: int, max_positions: int, layout: str = "interleaved",
                        offset: int = 0) -> nn.Module:
    if kind == "none":
        return NoPositionalEncoding(d_model, max_positions)
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_positions, layout)
    if kind == "learned":
        return LearnedPositionalEncoding(d_model, max_positions, offset)
    raise ValueError(f"unknown positional encoding {kind!r}")


__all__ = ["sinusoidal_table", "SinusoidalPositionalEncoding", "LearnedPositionalEncoding", "NoPositionalEncoding",
           "positional_encoding", "stack_positions"]

"""Token embeddings and weight tying (section 3.4).

"we use learned embeddings to convert the input tokens and output tokens to vectors of dimension
d_model ... we share the same weight matrix between the two embedding layers and the pre-softmax
linear transformation ... In the embedding layers, we multiply those weights by √d_model."

Initialisation N(0, d_model^-1/2) (as in tensor2tensor and fairseq), so that after the √d_model
scale the embeddings have unit variance, the same scale as the positional encodings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import PAD


class ScaledEmbedding(nn.Module):
    """``Embedding(x) · √d_model``; :meth:`logits` is the tied pre-softmax projection ``x Eᵀ``.

    The PAD row is zero and gets no gradient; ``pad_id=None``: no padding id (every id is a symbol).
    ``scale=False``: no √d_model factor (``ModelConfig.scale_embeddings``: BERT, GPT-2).
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int | None = PAD, scale: bool = True):
        super().__init__()
        self.d_model = d_model
        self.weight = nn.Parameter(torch.randn(vocab_size, d_model) * d_model**-0.5)
        if pad_id is not None:
            with torch.no_grad():
                self.weight[pad_id].zero_()
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model) if scale else 1.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight, self.pad_id) * self.scale  # (B, T, d_model)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-softmax linear transformation with the shared matrix: ``(B, T, d) -> (B, T, V)``."""
        return F.linear(x, self.weight)

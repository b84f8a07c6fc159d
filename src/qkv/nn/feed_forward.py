"""Position-wise feed-forward network (section 3.3).

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2

applied to each position separately and identically; inner dimension d_ff (2048 in the base
model). Dropout on the hidden activation is tensor2tensor's ``relu_dropout`` (off by default).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn.attention import eval_linear
from qkv.nn.dropout import dropout


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = dropout
        for lin in (self.w_1, self.w_2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.w_1(x))  # (B, T, d_ff)
        h = dropout(h, self.dropout, self.training)
        return self.w_2(h)  # (B, T, d_model)

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in eval mode (no dropout), without the module calls' overhead."""
        return eval_linear(self.w_2, F.relu(eval_linear(self.w_1, x)))

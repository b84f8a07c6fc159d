"""Position-wise feed-forward network (section 3.3).

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2

applied to each position separately and identically; inner dimension d_ff (2048 in the base
model). Dropout on the hidden activation is tensor2tensor's ``relu_dropout`` (off by default).

The paper's max(0, ·) is ReLU; the pretrained models qkv imports use others in its place
(``ModelConfig.activation``): GELU, exact (BERT) or its tanh approximation (GPT-2), and SiLU/swish
(Marian's OPUS-MT models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn.attention import eval_linear
from qkv.nn.dropout import dropout


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ModelConfig.activation -> the function between W_1 and W_2 (qkv.config.ACTIVATIONS names them)
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "silu": F.silu}


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = dropout
        for lin in (self.w_1, self.w_2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w_1(x))  # (B, T, d_ff)
        h = dropout(h, self.dropout, self.training)
        return self.w_2(h)  # (B, T, d_model)

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in eval mode (no dropout), without the module calls' overhead."""
        return eval_linear(self.w_2, self.act(eval_linear(self.w_1, x)))

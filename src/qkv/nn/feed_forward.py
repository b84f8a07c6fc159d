"""Position-wise feed-forward network (section 3.3).

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2

applied to each position separately and identically; inner dimension d_ff (2048 in the base
model). Dropout on the hidden activation is tensor2tensor's ``relu_dropout`` (off by default).

The paper's max(0, ·) is ReLU; the pretrained models qkv imports use others in its place
(``ModelConfig.activation``): GELU, exact (BERT) or its tanh approximation (GPT-2), and SiLU/swish
(Marian's OPUS-MT models).

Gated (``ModelConfig.ffn_gated``; Shazeer, 2020, "GLU Variants Improve Transformer"): a third matrix
W_3 gates the activation, FFN(x) = (act(x W_1) ⊙ x W_3) W_2: SwiGLU with SiLU (Llama, Qwen2, Mistral),
GeGLU with GELU (T5 v1.1's gated-gelu: its tanh approximation). ``bias=False``: no b_1, b_2 (T5, Llama).
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
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu", gated: bool = False,
                 bias: bool = True):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w_1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w_2 = nn.Linear(d_ff, d_model, bias=bias)
        self.w_3 = nn.Linear(d_model, d_ff, bias=bias) if gated else None  # the gate's linear half (after w_2: old names keep their order)
        self.dropout = dropout
        for lin in (self.w_1, self.w_2, self.w_3):
            if lin is not None:
                nn.init.xavier_uniform_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w_1(x))  # (B, T, d_ff)
        if self.w_3 is not None:
            h = h * self.w_3(x)
        h = dropout(h, self.dropout, self.training)
        return self.w_2(h)  # (B, T, d_model)

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in eval mode (no dropout), without the module calls' overhead."""
        h = self.act(eval_linear(self.w_1, x))
        if self.w_3 is not None:
            h = h * eval_linear(self.w_3, x)
        return eval_linear(self.w_2, h)

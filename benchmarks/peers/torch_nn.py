"""``torch.nn.Transformer`` as the paper's model, for training: batch_first, post-norm
(norm_first=False), ReLU, scaled ``nn.Embedding`` shared by source, target and the pre-softmax
projection, the paper's sinusoidal positions, dropout on the embedding sums.

Differences torch.nn.Transformer imposes (it has no switch for them): one ``dropout`` for the
sublayer outputs, the attention weights and the FFN activation (qkv: no FFN-activation dropout),
and a final LayerNorm after each stack. Same loss and optimizer as the other peers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from peers.common import train_result
from peers.torchutil import adam, flops, generic_train_step, sinusoidal, smoothed_ce_sum, time_training, train_batch

PAD, BOS, EOS = 0, 2, 3


class PaperTransformer(nn.Module):
    def __init__(self, m: dict, max_positions: int = 1024):
        super().__init__()
        d = m["d_model"]
        self.embed = nn.Embedding(m["vocab"], d, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        self.scale, self.dropout = math.sqrt(d), nn.Dropout(m["dropout"])
        self.register_buffer("pe", sinusoidal(max_positions, d), persistent=False)
        self.tf = nn.Transformer(d, m["n_heads"], m["layers"], m["layers"], m["d_ff"], m["dropout"],
                                 activation="relu", batch_first=True, norm_first=False)

    def _in(self, tokens):
        return self.dropout(self.embed(tokens) * self.scale + self.pe[: tokens.size(1)])

    def forward(self, src, tgt_in):
        t = tgt_in.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.float32)
        src_pad = torch.zeros(src.shape).masked_fill(src == PAD, float("-inf"))  # float, as the causal mask
        tgt_pad = torch.zeros(tgt_in.shape).masked_fill(tgt_in == PAD, float("-inf"))
        h = self.tf(self._in(src), self._in(tgt_in), tgt_mask=causal, tgt_is_causal=True,
                    src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return h @ self.embed.weight.t()  # tied pre-softmax projection


def run(task: str, spec: dict, threads: int) -> dict:
    if task != "train":
        raise ValueError("torch.nn.Transformer has no incremental decoding: training only")
    torch.manual_seed(0)
    model = PaperTransformer(spec["model"])
    src, tgt_in, tgt_out = train_batch(spec, BOS, EOS)
    eps = spec["train"]["label_smoothing"]
    opt = adam(model.parameters(), spec)
    step = generic_train_step(model, opt, lambda: smoothed_ce_sum(model(src, tgt_in), tgt_out, PAD, eps),
                              int((tgt_out != PAD).sum()), spec["train"]["clip_norm"])
    seconds = time_training(step, spec)
    return train_result(spec, seconds, parameters=sum(p.numel() for p in model.parameters()),
                        torch=torch.__version__, **flops(spec))

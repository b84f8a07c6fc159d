"""Dynamic int8 quantisation of a loaded model for faster CPU decoding (``qkv.load(path, quantize="int8")``;
its speed and BLEU cost are in docs/results.md)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from qkv.errors import QkvError

QUANTIZE_CHOICES = (None, "int8")

#: The smallest weight matrix (in entries) :func:`quantize_int8` makes int8 by default. A dynamic int8
#: product first quantises its input (a pass for the range, one to round), a fixed cost of tens of
#: microseconds per call that a small product never earns back: at d_model 128 the attention and FFN
#: matrices (128 x 128 to 512 x 128) ran no faster or slower in int8 for 1 to 160 rows, while
#: 512 x 512 and larger, and a 4,000 x 128 output projection, ran 1.5 to 5 times faster
#: (one EPYC thread; ``benchmarks/decode_speed.py`` measures the whole decoder).
MIN_INT8_WEIGHTS = 2**17


class Int8TiedOutput(nn.Module):
    """A shared (tied) embedding whose pre-softmax projection ``x Eᵀ`` runs as an int8 matrix
    multiply; the embedding lookup itself stays float. Replaces ``model.tgt_embed`` (and
    ``src_embed`` when shared): the tied projection is ``F.linear`` with the embedding matrix,
    not an ``nn.Linear``, so ``quantize_dynamic`` alone would leave it in float32."""

    def __init__(self, embed: nn.Module, qconfig):
        super().__init__()
        self.embed = embed
        vocab, d_model = embed.weight.shape
        linear = nn.Linear(d_model, vocab, bias=False)
        linear.weight = embed.weight  # quantised from the same matrix; the float one is kept for lookups
        self.proj = _quantize_dynamic(nn.Sequential(linear), {nn.Linear: qconfig})[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)  # (B, T, V)


def _quantize_dynamic(module: nn.Module, spec) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*")
        return quantize_dynamic(module, spec, dtype=torch.qint8, inplace=True)


def quantize_int8(model: nn.Module, output_projection: bool = True, min_weights: int = MIN_INT8_WEIGHTS) -> nn.Module:
    """Dynamic int8 quantisation for CPU decoding, in place (``torch.ao.quantization.quantize_dynamic``).

    Every ``nn.Linear`` of at least ``min_weights`` entries (:data:`MIN_INT8_WEIGHTS`: smaller
    ones are as fast in float32; 0: every one), and the ``nn.LSTM``/``nn.GRU`` of a recurrent
    model, gets int8 weights (one scale per output row); activations are quantised
    on the fly at each call, and everything else (embeddings, LayerNorm, softmax) stays float32.
    Two exceptions: each decoder layer's cross-attention ``in_proj`` stays float (its query and
    key/value parts are read as slices of the fused matrix; the keys/values are computed once
    per sentence anyway), and the tied output projection, which is not an ``nn.Linear``, is
    quantised through :class:`Int8TiedOutput` (at least ``min_weights`` entries too) unless
    ``output_projection=False``. For inference only: the result cannot be trained or saved as a
    checkpoint.
    """
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    if device.type != "cpu":
        raise QkvError(f"int8 quantisation runs on the CPU only; the model is on {device} (load it with device='cpu')")
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    if not engines:
        raise QkvError("int8 quantisation: this torch build has no quantized CPU engine")
    if torch.backends.quantized.engine == "none":
        torch.backends.quantized.engine = engines[0]
    from torch.ao.quantization import per_channel_dynamic_qconfig as qconfig

    sliced = {id(layer.cross_attn.in_proj) for layer in getattr(model, "decoder_layers", [])}
    # nn.LSTM and nn.GRU have dynamic int8 kernels too (nn.RNN has none and stays float32)
    spec = {name: qconfig for name, m in model.named_modules()
            if (isinstance(m, (nn.LSTM, nn.GRU)) or isinstance(m, nn.Linear) and m.weight.numel() >= min_weights)
            and id(m) not in sliced}
    # a tied output projection through a ScaledEmbedding (the Transformer); a recurrent model's stays float32
    tied = (output_projection and getattr(model, "output_proj", "absent") is None
            and hasattr(getattr(model, "tgt_embed", None), "logits") and model.tgt_embed.weight.numel() >= min_weights)
    model.eval()
    _quantize_dynamic(model, spec)
    if tied:
        shared = model.src_embed is model.tgt_embed
        model.tgt_embed = Int8TiedOutput(model.tgt_embed, qconfig)
        if shared:
            model.src_embed = model.tgt_embed
    return model


__all__ = ["quantize_int8", "Int8TiedOutput", "QUANTIZE_CHOICES", "MIN_INT8_WEIGHTS"]

"""Dynamic int8 quantisation of a loaded model for faster CPU decoding and encoding (``qkv.load(path,
quantize="int8")``; its speed, its BLEU cost and its embeddings' agreement with float32 are in docs/results.md).

Two schemes. Decoders (translation, language models) take torch's dynamic int8 ``nn.Linear``: one
activation scale per call, 7-bit activations on x86 (``reduce_range``). Encoders (classify, mlm:
what ``embed`` runs) need more: a sentence embedding is a mean over states, and BERT-style
encoders carry a few outlier channels and tokens ([CLS], [SEP]) whose range, shared by the whole
call, left short texts at a cosine of 0.88 against the float model (all-MiniLM-L6-v2). So an
encoder's linear maps are :class:`RowInt8Linear` (one activation scale per token, SmoothQuant's per-channel balancing of the attention and FFN inputs, calibrated once on
:data:`CALIBRATION` sentences), and its FFN output maps stay float32 (their GELU inputs' range is
what int8 cannot hold)."""

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


#: Sentences an encoder reads once when it is made int8: the range of each channel at the input of its
#: attention and FFN maps (SmoothQuant's calibration). Short and long, plain and odd, and a blank text.
CALIBRATION = (
    "The cat sat on the mat.", "How do I reset my password?", "Stocks rallied after the announcement.",
    "She plays the violin beautifully.", "It's raining again!!", "Paris is the capital of France.",
    "I don't like it at all", "Numbers like 42 and 3.5 appear here.", "ok", "Hello world", "",
)
SMOOTHING = 0.8  # SmoothQuant's alpha: the share of each channel's range moved from activations to weights


class RowInt8Linear(nn.Module):
    """``y = x Wᵀ + b`` with int8 weights (one scale per output row) and int8 activations with one scale
    per row of ``x`` (a token).

    Each row is divided by its largest magnitude ``r`` before torch's dynamic int8 product (whose one
    scale per call then fits every row alike) and the product multiplied by ``r`` after: the map is
    linear, so nothing changes in float, and a token of large states no longer coarsens the others.
    ``smooth`` (SmoothQuant, Xiao et al. 2023): per input channel ``s``, the weights' columns times
    ``s`` and the input divided by it, ``x Wᵀ = (x / s)(W diag(s))ᵀ``, which moves an outlier channel's
    range from the activations, quantised per row, into the weights, quantised per output row.
    Activations keep torch's 7-bit range (``reduce_range``): on x86 CPUs without VNNI the int8 kernels
    add pairs of 8-bit products in 16 bits, which saturate over the full range (measured: 13-16% error
    per row on random weights, against 1.5% with the 7-bit range)."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor | None = None):
        super().__init__()
        from torch.ao.quantization import per_channel_dynamic_qconfig

        weight = linear.weight.detach()
        inner = nn.Linear(linear.in_features, linear.out_features, bias=False)
        inner.weight = nn.Parameter(weight * smooth if smooth is not None else weight.clone())
        self.int8 = _quantize_dynamic(nn.Sequential(inner), {nn.Linear: per_channel_dynamic_qconfig})[0]
        self.register_buffer("inv_smooth", None if smooth is None else 1.0 / smooth)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        r = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)  # (..., 1): each token's own scale
        y = torch.ops.quantized.linear_dynamic(x / r, self.int8._packed_params._packed_params, True)
        y = y.to(x.dtype) * r
        return y if self.bias is None else y + self.bias


def smoothing(linear: nn.Linear, act_max: torch.Tensor, alpha: float = SMOOTHING) -> torch.Tensor:
    """SmoothQuant's ``s_j = max|X_j|^α / max|W_j|^(1-α)`` per input channel j, scaled to mean 1."""
    w_max = linear.weight.detach().abs().amax(0).clamp_min(1e-5)
    s = (act_max.clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp_min(1e-5)
    return s / s.mean()


def _input_ranges(model: nn.Module, names: list[str], calibration: torch.Tensor) -> dict[str, torch.Tensor]:
    """The largest magnitude of each input channel of the linear maps ``names`` over ``calibration``
    (``(B, T)`` tokens through ``model.encode``)."""
    ranges: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach()
            m = x.abs().reshape(-1, x.shape[-1]).amax(0)
            ranges[name] = m if name not in ranges else torch.maximum(ranges[name], m)
        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.inference_mode():
            model.encode(calibration)
    finally:
        for h in handles:
            h.remove()
    return ranges


def _quantize_encoder(model: nn.Module, calibration: torch.Tensor, min_weights: int) -> set[str]:
    """An encoder's layers as :class:`RowInt8Linear` (smoothed where they read a LayerNorm's output: the
    attention's Q/K/V and the FFN's first map), its FFN output maps left float32; the names replaced."""
    layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("encoder_layers.")
              and m.weight.numel() >= min_weights]
    smoothed = [n for n in layers if n.endswith(("self_attn.in_proj", "ffn.w_1"))]
    ranges = _input_ranges(model, smoothed, calibration)
    for name in layers:
        if name.endswith("ffn.w_2"):
            continue
        parent, leaf = name.rsplit(".", 1)
        linear = model.get_submodule(name)
        smooth = smoothing(linear, ranges[name]) if name in ranges else None
        setattr(model.get_submodule(parent), leaf, RowInt8Linear(linear, smooth))
    return set(layers)


def quantize_int8(model: nn.Module, output_projection: bool = True, min_weights: int = MIN_INT8_WEIGHTS,
                  calibration: torch.Tensor | None = None) -> nn.Module:
    """Dynamic int8 quantisation for CPU decoding, in place (``torch.ao.quantization.quantize_dynamic``).

    Every ``nn.Linear`` of at least ``min_weights`` entries (:data:`MIN_INT8_WEIGHTS`: smaller
    ones are as fast in float32; 0: every one), and the ``nn.LSTM``/``nn.GRU`` of a recurrent
    model, gets int8 weights (one scale per output row); activations are quantised
    on the fly at each call, and everything else (embeddings, LayerNorm, softmax) stays float32.
    Two exceptions: each decoder layer's cross-attention ``in_proj`` stays float (its query and
    key/value parts are read as slices of the fused matrix; the keys/values are computed once
    per sentence anyway), and the tied output projection, which is not an ``nn.Linear``, is
    quantised through :class:`Int8TiedOutput` (at least ``min_weights`` entries too) unless
    ``output_projection=False``. ``calibration`` (``(B, T)`` tokens, an encoder-only model's input):
    the encoder's layers take the per-token scheme of the module docstring instead. For inference
    only: the result cannot be trained or saved as a checkpoint.
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

    model.eval()
    done = set()
    if calibration is not None:
        if not hasattr(model, "encode") or hasattr(model, "decoder_layers") or not hasattr(model, "encoder_layers"):
            raise QkvError("int8 calibration is for encoder-only Transformers (classify, mlm)")
        done = _quantize_encoder(model, calibration.to(device), min_weights)
    sliced = {id(layer.cross_attn.in_proj) for layer in getattr(model, "decoder_layers", [])}
    # nn.LSTM and nn.GRU have dynamic int8 kernels too (nn.RNN has none and stays float32)
    spec = {name: qconfig for name, m in model.named_modules()
            if (isinstance(m, (nn.LSTM, nn.GRU)) or isinstance(m, nn.Linear) and m.weight.numel() >= min_weights)
            and id(m) not in sliced and name not in done}
    # a tied output projection through a ScaledEmbedding (the Transformer); a recurrent model's stays float32
    tied = (output_projection and getattr(model, "output_proj", "absent") is None
            and hasattr(getattr(model, "tgt_embed", None), "logits") and model.tgt_embed.weight.numel() >= min_weights)
    _quantize_dynamic(model, spec)
    if tied:
        shared = model.src_embed is model.tgt_embed
        model.tgt_embed = Int8TiedOutput(model.tgt_embed, qconfig)
        if shared:
            model.src_embed = model.tgt_embed
    return model


__all__ = ["quantize_int8", "Int8TiedOutput", "RowInt8Linear", "QUANTIZE_CHOICES", "MIN_INT8_WEIGHTS", "CALIBRATION"]

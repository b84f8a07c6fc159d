"""The decoder-only Transformer: a causal language model (the Transformer decoder without
cross-attention; Liu et al., 2018, "Generating Wikipedia by Summarizing Long Sequences";
Radford et al., 2018).

    tokens -> Embedding·√d_model + PE -> Dropout
           -> N × [masked self-attention, position-wise FFN]   (each in a residual + LayerNorm)
           -> Linear (tied to the embedding) -> softmax

    p(x) = Π_t p(x_t | x_<t)

The model is one :class:`~qkv.nn.stack.TransformerStack` (:attr:`DecoderOnlyTransformer.decoder`)
of :class:`~qkv.nn.layers.EncoderLayer`: the decoder layer without cross-attention is the encoder
layer run with the causal mask (and, when decoding, a key/value cache). Training runs a whole
sequence at once with the causal mask (position t sees positions <= t, section 3.2.3), so one
forward pass predicts every next token.

Incremental decoding uses the same interface as the encoder–decoder (:mod:`qkv.decoding`):

* :meth:`DecoderOnlyTransformer.start` runs a prefix ``(B, P)`` once and fills a key/value cache
  per layer;
* :meth:`DecoderOnlyTransformer.step` feeds one token per row and returns the next-token logits.

Prefixes of different lengths share a batch right-padded with PAD. Each row then has its own
position counter (the next token of a row with ``n`` prefix tokens is at position ``n``) and
the state keeps a key mask: cached keys that are padding are hidden from every later query. A
row thus gives the same logits in a batch as alone.

For the prefix language model (``sep_id`` set), ``start(src)`` reads the source followed by the
separator ``<sep>``, and the first ``step`` is fed BOS, as for every qkv decoder; the training
sequence is ``src <sep> BOS tgt EOS`` and :mod:`qkv.decoding`'s greedy and beam search work
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import PAD, SEP, ModelConfig
from qkv.masks import key_padding_mask, prefix_mask, real_tokens
from qkv.nn.attention import KVCache
from qkv.nn.embedding import ScaledEmbedding
from qkv.nn.layers import EncoderLayer
from qkv.nn.stack import TransformerStack, stack_modules


@dataclass
class DecoderOnlyState:
    """Incremental decoding state: the cached keys/values, which of them are real, and where each row is."""

    kv: list[KVCache]  # per layer, (B, h, T, d_k): grows by one position per step
    key_mask: torch.Tensor  # (B, T) bool: True where the cached position is a real token (not padding)
    positions: torch.Tensor  # (B,) long: the position of each row's next token

    def reorder(self, indices: torch.Tensor) -> "DecoderOnlyState":
        """Select/reorder batch rows (beam back-pointers, dropping finished rows)."""
        return DecoderOnlyState(
            [kv.reorder(indices) for kv in self.kv],
            self.key_mask.index_select(0, indices),
            self.positions.index_select(0, indices),
        )


class DecoderOnlyTransformer(nn.Module):
    """A causal Transformer language model over one vocabulary (``cfg.tgt_vocab_size``) with
    ``cfg.n_decoder_layers`` layers."""

    def __init__(self, cfg: ModelConfig, sep_id: int | None = None):
        """``sep_id``: the separator ``start`` appends to a source (default: ``<sep>`` for the
        prefix_lm task, none for lm)."""
        super().__init__()
        if sep_id is None and getattr(cfg, "task", "lm") == "prefix_lm":
            sep_id = SEP
        cfg.validate()
        if cfg.tgt_vocab_size <= 0:
            raise ValueError("ModelConfig.tgt_vocab_size must be set (from the tokenizer)")
        self.cfg, self.sep_id = cfg, sep_id
        d = cfg.d_model
        self.embed = ScaledEmbedding(cfg.tgt_vocab_size, d, scale=cfg.scale_embeddings)
        self.output_proj = None if cfg.tie_output else nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        self.pos, self.layers, self.final_norm = stack_modules(cfg, cfg.n_decoder_layers, EncoderLayer)
        self.output_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size)) if cfg.output_bias else None

    @property
    def decoder(self) -> TransformerStack:
        """The stack: token embedding, positions, N layers (run causally), final norm."""
        return TransformerStack(self.embed, self.pos, self.layers, self.final_norm, self.cfg.dropout)

    # --- pieces ------------------------------------------------------------------------------------

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.embed.logits(x) if self.output_proj is None else self.output_proj(x)  # (B, T, V)
        return logits if self.output_bias is None else logits + self.output_bias

    @property
    def output_weight(self) -> torch.Tensor:
        """The pre-softmax projection ``(V, d)``: logits = final_norm(x) @ output_weight.T."""
        return self.embed.weight if self.output_proj is None else self.output_proj.weight

    # --- training ----------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, need_weights: bool = False, features: bool = False):
        """``tokens (B, T)`` (right-padded) -> next-token logits ``(B, T, V)``: position t predicts x_{t+1}.
        With ``features``: the final (normalised) states ``(B, T, d)`` before the output projection
        (:attr:`output_weight`), for :func:`qkv.losses.linear_label_smoothed_nll_loss`.

        With right padding the causal mask alone suffices: a real position never sees a pad
        (pads come after it), and outputs at pad positions are ignored by the loss.
        With ``need_weights`` also returns each layer's attention weights ``(B, h, T, T)``.
        """
        x, _, weights = self.decoder(tokens, causal=True, need_weights=need_weights)
        if features:
            return x
        logits = self._logits(x)
        return (logits, weights) if need_weights else logits

    def attention_maps(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's masked self-attention weights ``(B, h, T, T)`` from one forward pass
        (for the visualiser): returned by the layers when asked, nothing is stored. Row i sums
        to 1 over the keys j <= i; the future (j > i) gets weight 0."""
        _, weights = self(tokens, need_weights=True)
        return weights

    # --- incremental decoding ----------------------------------------------------------------------

    def with_separator(self, src: torch.Tensor) -> torch.Tensor:
        """``src (B, S)`` right-padded -> ``(B, S + 1)`` with ``<sep>`` after each row's last real token."""
        lengths = real_tokens(src).sum(dim=1)  # (B,)
        out = F.pad(src, (0, 1), value=PAD)  # (B, S + 1)
        out[torch.arange(src.size(0), device=src.device), lengths] = self.sep_id
        return out

    def start(self, prefix: torch.Tensor) -> DecoderOnlyState:
        """Run ``prefix (B, P)`` (right-padded with PAD; P may be 0) once and cache every layer's
        keys and values. For a prefix LM (``sep_id`` set) the separator is appended first."""
        if self.sep_id is not None:
            prefix = self.with_separator(prefix)
        real = real_tokens(prefix)  # (B, P)
        # Padding trails, so every row's positions are 0..P-1; the mask is causal and hides padding.
        decoder = self.decoder
        caches = decoder.empty_caches(prefix.size(0), self.embed.weight)
        _, kv, _ = decoder(prefix, mask=prefix_mask(prefix), caches=caches)
        return DecoderOnlyState(kv, real, real.sum(dim=1))

    def max_source_len(self) -> int | None:
        """The longest prefix row :meth:`start` should read, None with sinusoidal positions (any
        length). With learned positions a language model may fill all but one (for a :meth:`step`);
        a prefix LM keeps half of them for the target, after the source and the separator."""
        if self.cfg.positional != "learned":
            return None
        return self.cfg.max_positions - 1 if self.sep_id is None else (self.cfg.max_positions - 1) // 2

    def max_steps(self, src_lengths: torch.Tensor) -> torch.Tensor | int | None:
        """How many :meth:`step` calls the state of ``start(prefix)`` takes, per row: the learned
        positions the prefix (``src_lengths`` real tokens, then the separator) leaves; None: no limit."""
        if self.cfg.positional != "learned":
            return None
        return self.cfg.max_positions - torch.as_tensor(src_lengths) - int(self.sep_id is not None)

    def step(self, tokens: torch.Tensor, state: DecoderOnlyState) -> tuple[torch.Tensor, DecoderOnlyState]:
        """Feed one token per row ``(B,)`` -> next-token logits ``(B, V)`` and the grown state."""
        key_mask = torch.cat([state.key_mask, state.key_mask.new_ones(tokens.size(0), 1)], dim=1)  # (B, T + 1)
        # The new query sees every real key: the cached ones and itself.
        x, kv, _ = self.decoder(tokens[:, None], state.positions[:, None], caches=state.kv,
                                mask=key_padding_mask(key_mask),
                                key_positions=key_mask.long().cumsum(1) - 1)  # (B, 1, d); keys' positions: relative

        logits = self._logits(x)[:, 0]  # (B, V)
        return logits, DecoderOnlyState(kv, key_mask, state.positions + 1)

"""The Transformer encoder–decoder (section 3, Figure 1).

    src tokens -> Embedding·√d_model + PE -> Dropout -> N × EncoderLayer            = memory
    tgt tokens (shifted right) -> Embedding·√d_model + PE -> Dropout
               -> N × DecoderLayer(masked self-attention, cross-attention to memory, FFN)
               -> Linear (shared with the embeddings) -> softmax

Each half is one :class:`~qkv.nn.stack.TransformerStack` (:attr:`Transformer.encoder`,
:attr:`Transformer.decoder`). Training runs the whole target at once (teacher forcing, causal
mask). Decoding runs one position at a time through :meth:`Transformer.start` /
:meth:`Transformer.step` with an explicit :class:`TransformerState`: self-attention keys/values
are cached per layer, cross-attention keys/values are computed once per sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import ModelConfig
from qkv.masks import padding_mask
from qkv.nn.attention import KVCache
from qkv.nn.embedding import ScaledEmbedding
from qkv.nn.layers import DecoderLayer, DecoderLayerWeights, EncoderLayer
from qkv.nn.stack import TransformerStack, stack_modules


@dataclass
class TransformerState:
    """Incremental decoding state: everything :meth:`Transformer.step` needs, nothing hidden.

    In beam search (``beam = k > 1``, after :meth:`expand_beams`) the decoder runs ``N * k`` rows,
    sentence-major (row ``i * k + j`` is hypothesis ``j`` of sentence ``i``), but the source side
    stays per sentence: the ``k`` hypotheses of a sentence attend to the same ``N`` keys/values
    (see :meth:`MultiHeadAttention.cross_attention`), which are therefore never copied per hypothesis.
    """

    memory_mask: torch.Tensor  # (N, 1, 1, S)
    cross_kv: list[KVCache]  # per decoder layer, (N, h, S, d_k): computed once, one per sentence
    self_kv: list[KVCache]  # per decoder layer, (N * beam, h, t, d_k): grows by one per step
    position: int  # number of target positions decoded so far
    beam: int = 1  # decoder rows per source sentence
    memory_bias: torch.Tensor | None = None  # (N, 1, 1, S) memory_mask as 0 / -inf (None: made from it per step)
    # Static shapes (start_static): self_kv are buffers of a fixed capacity C, a position written at each
    # step, and this (1, 1, 1, C) bias is 0 at the positions written so far and -inf after them.
    self_bias: torch.Tensor | None = None

    def expand_beams(self, k: int) -> "TransformerState":
        """``k`` rows per sentence for beam search: row ``i * k + j`` starts as row ``i``.

        Only the self-attention caches are repeated; the cross-attention keys/values and the
        memory mask stay one per sentence."""
        assert self.beam == 1, "expand_beams on a state that already has beams"
        rows = torch.arange(self.memory_mask.size(0), device=self.memory_mask.device).repeat_interleave(k)
        return replace(self, self_kv=[kv.reorder(rows) for kv in self.self_kv], beam=k)

    def reorder(self, indices: torch.Tensor) -> "TransformerState":
        """Select/reorder batch rows (beam back-pointers, dropping finished sentences): row ``r``
        of the result is row ``indices[r]``.

        With ``beam = k > 1``, ``indices`` must keep the layout: each group of ``k`` consecutive
        new rows comes from one sentence's ``k`` rows (what beam search's ``_advance`` gives:
        ``rows = sentence * k + back-pointer``). Then only the self-attention caches follow the
        back-pointers; the per-sentence cross-attention keys/values and mask are selected by
        sentence, and not copied at all while no sentence is dropped or moved."""
        if self.beam == 1:
            return replace(
                self,
                memory_mask=self.memory_mask.index_select(0, indices),
                cross_kv=[kv.reorder(indices) for kv in self.cross_kv],
                self_kv=[kv.reorder(indices) for kv in self.self_kv],
                memory_bias=_select(self.memory_bias, indices),
            )
        k, n = self.beam, self.memory_mask.size(0)
        groups = indices.view(-1, k) // k  # (N', k) the sentence of each new row
        sents = groups[:, 0]  # (N',)
        assert bool((groups == sents.unsqueeze(1)).all()), "each group of beam rows must come from one sentence"
        self_kv = [kv.reorder(indices) for kv in self.self_kv]
        if sents.numel() == n and torch.equal(sents, torch.arange(n, device=sents.device)):
            return replace(self, self_kv=self_kv)  # the same sentences in the same order
        return replace(
            self,
            memory_mask=self.memory_mask.index_select(0, sents),
            cross_kv=[kv.reorder(sents) for kv in self.cross_kv],
            self_kv=self_kv,
            memory_bias=_select(self.memory_bias, sents),
        )


def _select(x: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x.index_select(0, rows)


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask (True = may attend) as the float one that
    :func:`~torch.nn.functional.scaled_dot_product_attention` makes of it: 0 where True, -inf
    where False; given to it, the same result, without the conversion at every call."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


@dataclass
class AttentionMaps:
    """Attention weights of every layer and head, returned when ``need_weights=True``."""

    encoder: list[torch.Tensor]  # per layer (B, h, S, S)
    decoder_self: list[torch.Tensor]  # per layer (B, h, T, T)
    cross: list[torch.Tensor]  # per layer (B, h, T, S)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.src_vocab_size <= 0 or cfg.tgt_vocab_size <= 0:
            raise ValueError("ModelConfig.src_vocab_size and tgt_vocab_size must be set (from the tokenizer)")
        self.cfg = cfg
        d = cfg.d_model
        self.src_embed = ScaledEmbedding(cfg.src_vocab_size, d, scale=cfg.scale_embeddings)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else ScaledEmbedding(cfg.tgt_vocab_size, d, scale=cfg.scale_embeddings)
        self.output_proj = None if cfg.tie_output else nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        src_pos, encoder_layers, encoder_norm = stack_modules(cfg, cfg.n_encoder_layers, EncoderLayer)
        tgt_pos, decoder_layers, decoder_norm = stack_modules(cfg, cfg.n_decoder_layers, DecoderLayer)
        # Registered in the order the model always had: parameters() keeps it, and saved optimizer states follow it.
        self.src_pos, self.tgt_pos = src_pos, tgt_pos
        self.encoder_layers, self.decoder_layers = encoder_layers, decoder_layers
        self.encoder_norm, self.decoder_norm = encoder_norm, decoder_norm
        # Marian's final_logits_bias (cfg.output_bias); registered last, after every older parameter
        self.output_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size)) if cfg.output_bias else None
        # BART's layernorm_embedding (cfg.embedding_norm): a LayerNorm of each stack's embeddings + positions
        self.src_embed_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.embedding_norm else None
        self.tgt_embed_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.embedding_norm else None

    @property
    def encoder(self) -> TransformerStack:
        """The left half of Figure 1: source embedding, positions, N encoder layers."""
        return TransformerStack(self.src_embed, self.src_pos, self.encoder_layers, self.encoder_norm, self.cfg.dropout,
                                embed_norm=self.src_embed_norm)

    @property
    def decoder(self) -> TransformerStack:
        """The right half of Figure 1, up to the output projection: target embedding, positions,
        N decoder layers."""
        return TransformerStack(self.tgt_embed, self.tgt_pos, self.decoder_layers, self.decoder_norm, self.cfg.dropout,
                                embed_norm=self.tgt_embed_norm)

    # --- pieces ------------------------------------------------------------------------------------

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tgt_embed.logits(x) if self.output_proj is None else self.output_proj(x)  # (B, T, V)
        return logits if self.output_bias is None else logits + self.output_bias

    def memory_kv(self, memory: torch.Tensor) -> list[KVCache]:
        """Every decoder layer's cross-attention keys/values of the encoder output ``memory (B, S, d)``."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]

    def encode(self, src: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor, list]:
        """``src (B, S)`` -> memory ``(B, S, d)``, its padding mask ``(B, 1, 1, S)``, encoder weights."""
        mask = padding_mask(src)  # (B, 1, 1, S)
        memory, _, weights = self.encoder(src, mask=mask, need_weights=need_weights)
        return memory, mask, weights

    def decode(
        self, tgt_in: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor, need_weights: bool = False,
        features: bool = False,
    ) -> tuple[torch.Tensor, list[DecoderLayerWeights]]:
        """Teacher forcing: ``tgt_in (B, T)`` (BOS + target) -> logits ``(B, T, V)`` (with
        ``features``: the final states ``(B, T, d)`` before the output projection)."""
        x, _, weights = self.decoder(tgt_in, memory_kv=self.memory_kv(memory), memory_mask=memory_mask,
                                     need_weights=need_weights)
        return (x if features else self._logits(x)), weights

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, features: bool = False) -> torch.Tensor:
        """``src (B, S)``, ``tgt_in (B, T)`` -> logits ``(B, T, V)``; with ``features`` the decoder's
        final states ``(B, T, d)`` instead, for a loss that applies :attr:`output_weight` itself
        (:func:`qkv.losses.linear_label_smoothed_nll_loss`)."""
        memory, mask, _ = self.encode(src)
        out, _ = self.decode(tgt_in, memory, mask, features=features)
        return out

    @property
    def output_weight(self) -> torch.Tensor:
        """The pre-softmax projection ``(V, d)``: logits = x @ output_weight.T (the shared embedding when tied)."""
        return self.tgt_embed.weight if self.output_proj is None else self.output_proj.weight

    def attention_maps(self, src: torch.Tensor, tgt_in: torch.Tensor) -> AttentionMaps:
        """Every layer's attention weights from one forward pass (for the visualiser)."""
        memory, mask, enc_w = self.encode(src, need_weights=True)
        _, dec_w = self.decode(tgt_in, memory, mask, need_weights=True)
        return AttentionMaps(enc_w, [w.self_attn for w in dec_w], [w.cross_attn for w in dec_w])

    # --- incremental decoding ----------------------------------------------------------------------

    def start(self, src: torch.Tensor) -> TransformerState:
        """Encode ``src (B, S)`` and project the cross-attention keys/values once per layer."""
        memory, mask, _ = self.encode(src)
        return TransformerState(mask, self.memory_kv(memory), self.decoder.empty_caches(src.size(0), memory), 0,
                                memory_bias=additive_mask(mask).to(memory.dtype))

    def max_source_len(self) -> int | None:
        """The longest ``src`` row (EOS included) :meth:`start` reads: ``max_positions`` with learned
        positions; None (any length) with sinusoidal ones, whose table grows."""
        return self.cfg.max_positions if self.cfg.positional == "learned" else None

    def max_steps(self, src_lengths: torch.Tensor) -> torch.Tensor | int | None:
        """How many :meth:`step` calls the state of ``start(src)`` takes (a position each, from 0):
        ``max_positions`` with learned positions, whatever the source; None: no limit."""
        return self.cfg.max_positions if self.cfg.positional == "learned" else None

    def step(self, tokens: torch.Tensor, state: TransformerState) -> tuple[torch.Tensor, TransformerState]:
        """One decoding step: the last tokens ``(B,)`` -> next-token logits ``(B, V)``
        (``B = N * state.beam`` rows for ``N`` sentences).

        In eval mode each decoder layer runs its :meth:`~qkv.nn.layers.DecoderLayer.step`: the
        operations of the stack's, on ``(B, d)`` rows instead of ``(B, 1, d)`` and without the
        module calls, dropout or mask conversion (the same logits bit for bit); where the
        family switches make the step differ from the paper's (:attr:`has_static_step` false), the stack's."""
        if not self.training and self.has_static_step:
            return self._eval_step(tokens, state)
        x, self_kv, _ = self.decoder(tokens[:, None], state.position, caches=state.self_kv, memory_kv=state.cross_kv,
                                     memory_mask=state.memory_mask, beam=state.beam)  # (B, 1, d)
        logits = self._logits(x)[:, 0]  # (B, V)
        return logits, replace(state, self_kv=self_kv, position=state.position + 1)

    def _eval_step(self, tokens: torch.Tensor, state: TransformerState) -> tuple[torch.Tensor, TransformerState]:
        position = state.position
        bias = state.memory_bias if state.memory_bias is not None else additive_mask(state.memory_mask)
        x = self.tgt_embed(tokens) + self.tgt_pos(1, position)[0]  # (B, d)
        if self.tgt_embed_norm is not None:
            x = self.tgt_embed_norm(x)
        self_kv = []
        for layer, cache, memory_kv in zip(self.decoder_layers, state.self_kv, state.cross_kv):
            x, cache = layer.step(x, memory_kv, bias, cache, state.beam)
            self_kv.append(cache)
        logits = self._logits(self.decoder_norm(x))  # (B, V)
        return logits, TransformerState(state.memory_mask, state.cross_kv, self_kv, position + 1, state.beam,
                                        state.memory_bias)

    # --- incremental decoding with static shapes (qkv.decoding.compiled) ---------------------------

    @property
    def has_static_step(self) -> bool:
        """Whether :meth:`static_step` (and the eval-mode step) computes this model: positions added to the
        embeddings (not rotary or relative) and the paper's attention in every decoder layer (every head
        its own keys/values, 1/√d_k)."""
        return not hasattr(self.tgt_pos, "attention_inputs") and all(
            layer.self_attn.plain and layer.cross_attn.plain for layer in self.decoder_layers)

    def start_static(self, src: torch.Tensor, capacity: int, source_multiple: int) -> TransformerState:
        """:meth:`start` for :meth:`static_step`: the self-attention keys/values in zero buffers of
        ``capacity`` positions ``(B, h, C, d_k)`` with a ``self_bias`` that opens none yet, and the
        source side padded to a multiple of ``source_multiple`` positions (masked), so that a few
        shapes serve every batch."""
        memory, mask, _ = self.encode(src)
        pad = -memory.size(1) % source_multiple
        cross_kv = [KVCache(F.pad(kv.k, (0, 0, 0, pad)).contiguous(), F.pad(kv.v, (0, 0, 0, pad)).contiguous())
                    for kv in self.memory_kv(memory)]  # contiguous whatever the padding: the same strides
        mask = F.pad(mask, (0, pad), value=False)  # (B, 1, 1, S + pad)
        self_kv = []
        for layer in self.decoder_layers:
            attn = layer.self_attn
            k = memory.new_zeros(src.size(0), attn.n_heads, capacity, attn.d_k)
            self_kv.append(KVCache(k, torch.zeros_like(k)))
        self_bias = memory.new_full((1, 1, 1, capacity), float("-inf"))
        return TransformerState(mask, cross_kv, self_kv, 0, memory_bias=additive_mask(mask).to(memory.dtype),
                                self_bias=self_bias)

    def static_step(self, tokens: torch.Tensor, pos_enc: torch.Tensor, pos: torch.Tensor,
                    self_bias: torch.Tensor | None,
                    self_k: list[torch.Tensor], self_v: list[torch.Tensor], cross_k: list[torch.Tensor],
                    cross_v: list[torch.Tensor], memory_bias: torch.Tensor, beam: int, in_place: bool = True,
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The eval-mode step on tensors of fixed shapes, the function :mod:`qkv.decoding.compiled`
        compiles: ``tokens (B,)`` at position ``pos`` (LongTensor ``(1,)``, its encoding
        ``pos_enc (1, d)``) -> logits ``(B, V)``. The keys/values of ``pos`` are written into the
        buffers ``self_k``/``self_v`` ``(B, h, C, d_k)`` (``in_place``) or into copies of them;
        the buffers written are returned with the logits. ``self_bias (1, 1, 1, C)`` must already
        open ``pos``; None: the buffers are views of positions 0 .. ``pos`` only, attended unmasked
        (:mod:`qkv.decoding.scripted`)."""
        x = self.tgt_embed(tokens) + pos_enc  # (B, d)
        if self.tgt_embed_norm is not None:
            x = self.tgt_embed_norm(x)
        ks, vs = [], []
        for layer, k, v, ck, cv in zip(self.decoder_layers, self_k, self_v, cross_k, cross_v):
            x, k, v = layer.static_step(x, KVCache(ck, cv), memory_bias, k, v, pos, self_bias, beam, in_place)
            ks.append(k)
            vs.append(v)
        return self._logits(self.decoder_norm(x)), ks, vs  # (B, V)

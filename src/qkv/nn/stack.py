"""One Transformer stack (section 3.1, Figure 1), for every Transformer qkv has.

    tokens -> Embedding·√d_model + PE -> Dropout -> N layers (-> LayerNorm, pre-norm only)

The encoder-only model may also add a token-type embedding (row 0: qkv's inputs are one segment)
and normalise the sum before the dropout (``ModelConfig.type_vocab_size``, ``embedding_norm``: BERT's
embeddings), make its embeddings narrower than d_model and project them after the dropout
(``embedding_dim``: ALBERT's and ELECTRA's), and run its N layers from fewer sets of weights
(``layer_groups``, :class:`SharedLayers`: ALBERT's). Learned positions may start at a row of their
table other than the first (``position_offset``: RoBERTa's and BART's 2).

The encoder and the decoder of the encoder–decoder are each one stack (the decoder's layers also
read the encoder output); the encoder-only model is one stack of encoder layers, the
decoder-only model one stack of encoder layers run with the causal mask.

:func:`stack_modules` builds a stack's positional encoding, N layers and final LayerNorm from a
:class:`~qkv.config.ModelConfig`; :class:`TransformerStack` runs them after the token embedding.
The modules belong to the model, which registers them under the names its checkpoints have always
had (``src_pos``, ``encoder_layers``, ``encoder_norm``; ``pos``, ``layers``, ``final_norm``, ...)
and in the same order, so that ``state_dict()`` and the parameter order a saved optimizer state
follows stay those of every checkpoint written before; a model's ``encoder`` / ``decoder``
property hands them to a :class:`TransformerStack` each time it runs one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from qkv.config import ModelConfig
from qkv.nn.attention import KVCache, MultiHeadAttention
from qkv.nn.dropout import dropout
from qkv.nn.feed_forward import PositionwiseFeedForward
from qkv.nn.layers import Switches
from qkv.nn.norm import make_norm
from qkv.nn.positional import stack_positions


def stack_modules(
    cfg: ModelConfig, n_layers: int, layer: Callable[..., nn.Module]
) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """The positional encoding, ``n_layers`` layers (``EncoderLayer`` or ``DecoderLayer``) and the
    final norm of one stack: a LayerNorm with pre-norm layers (the residual stream is otherwise
    never normalised), nothing with the paper's post-norm ones. The family switches of ``cfg``
    (:class:`~qkv.nn.layers.Switches`, ``positional``) choose the modules; relative positions are
    causal in a decoder's stack (``DecoderLayer``, or the decoder-only tasks), bidirectional elsewhere.
    With ``layer_groups`` the N layers run from that many sets of weights (:class:`SharedLayers`)."""
    causal = getattr(layer, "__name__", "") == "DecoderLayer" or cfg.task in ("lm", "prefix_lm")
    pos = stack_positions(cfg, causal)
    args = (cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.attention_dropout, cfg.norm_first)
    options = dict(activation=cfg.activation, layer_norm_eps=cfg.layer_norm_eps, switches=Switches.of(cfg))
    layers = nn.ModuleList(layer(*args, **options) for _ in range(cfg.layer_groups or n_layers))
    if cfg.layer_groups:
        layers = SharedLayers(layers, n_layers)
    if cfg.init == "fairseq":
        fairseq_init(layers)
    norm = make_norm(cfg.norm, cfg.d_model, cfg.layer_norm_eps, cfg.norm_bias) if cfg.has_final_norm else nn.Identity()
    return pos, layers, norm


def embedding_width(cfg: ModelConfig) -> int:
    """The width of a stack's embeddings: ``embedding_dim`` (ALBERT's E, projected to d_model), else d_model."""
    return cfg.embedding_dim or cfg.d_model


def input_modules(cfg: ModelConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """The token-type table and the embedding LayerNorm of a stack, each None when the config has none
    (the paper's model: nothing is added to its modules or its checkpoints)."""
    e = embedding_width(cfg)
    types = nn.Embedding(cfg.type_vocab_size, e) if cfg.type_vocab_size else None
    if types is not None:
        nn.init.normal_(types.weight, std=e ** -0.5)
    norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps) if cfg.embedding_norm else None
    return types, norm


def projection_module(cfg: ModelConfig) -> nn.Module | None:
    """The map of the embeddings (width ``embedding_dim``) to d_model, None when they are d_model wide."""
    return nn.Linear(cfg.embedding_dim, cfg.d_model) if cfg.embedding_dim else None


class SharedLayers(nn.ModuleList):
    """``n_layers`` layers run from fewer sets of weights (``ModelConfig.layer_groups``, ALBERT's
    ``num_hidden_groups``): layer i is set ``floor(i · groups / n_layers)``, as ALBERT groups them.

    Iterating, indexing and ``len`` see the N layers as they run (the same module for the layers of a
    group); the module tree and ``state_dict()`` hold each set of weights once."""

    def __init__(self, layers: nn.ModuleList, n_layers: int):
        nn.Module.__init__(self)  # not ModuleList's: it numbers what it adds by len(self), the N layers here
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)
        groups = len(layers)
        self.order = tuple(int(i / (n_layers / groups)) for i in range(n_layers))  # ALBERT's group_idx

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter([self._modules[str(g)] for g in self.order])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(len(self))[idx]]
        return self._modules[str(self.order[idx])]


def fairseq_init(layers: nn.Module) -> None:
    """Start the layers' linear maps as fairseq's Transformer does (``init = "fairseq"``): the FFN's
    weights and biases and the Q, K, V biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)), torch's Linear
    default, instead of Xavier-uniform FFN weights and zero biases. Q, K, V and W^O weights stay
    Xavier-uniform (over the stacked (3d, d) matrix that is the bound of fairseq's per-matrix Xavier
    with gain 1/sqrt(2)), W^O's bias zero. Raced against fairseq on Multi30k (docs/results.md), the
    Xavier start learned markedly less per update."""
    for m in layers.modules():
        if isinstance(m, PositionwiseFeedForward):
            for lin in (m.w_1, m.w_2, m.w_3):
                if lin is not None:
                    lin.reset_parameters()
        elif isinstance(m, MultiHeadAttention) and m.in_proj.bias is not None:
            bound = m.in_proj.in_features ** -0.5
            with torch.no_grad():
                m.in_proj.bias.uniform_(-bound, bound)


@dataclass(frozen=True, eq=False)
class TransformerStack:
    """A model's token embedding, positional encoding, layers and final norm, run as one stack.

    Compared and hashed by identity (``eq=False``): a hash of the fields made ``torch.compile`` of the
    training forward fail under torch 2.11 (dynamo hashes the stack it builds while tracing, before the
    fields exist: "'TransformerStack' object has no attribute 'embed'")."""

    embed: nn.Module  # ScaledEmbedding: tokens (B, T) -> (B, T, d), already scaled by √d_model
    pos: nn.Module  # positional encoding: (length, offset) -> (1, T, d)
    layers: nn.ModuleList
    norm: nn.Module
    dropout: float
    types: nn.Module | None = None  # token-type table (row 0 added everywhere), or None
    embed_norm: nn.Module | None = None  # LayerNorm of the embedding sum, or None
    proj: nn.Module | None = None  # the embeddings' map to d_model (ModelConfig.embedding_dim), or None

    def inputs(self, tokens: torch.Tensor, positions: int | torch.Tensor = 0) -> torch.Tensor:
        """Embedding·√d_model + PE, then dropout: ``tokens (B, T)`` -> ``(B, T, d)``.

        ``positions``: the position of the first token, the same for every row, or each token's
        own ``(B, T)`` (rows of a batch at different points of their sequences).
        """
        if isinstance(positions, int):
            pe = self.pos(tokens.size(1), positions)  # (1, T, d)
        else:
            pe = self.pos(int(positions.max()) + 1 if positions.numel() else 1)[0][positions]  # (B, T, d)
        x = self.embed(tokens) + pe  # (B, T, d)
        if self.types is not None:
            x = x + self.types.weight[0]  # every token is of segment 0
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = dropout(x, self.dropout, self.layers.training)  # training: as the model's modules are
        return x if self.proj is None else self.proj(x)

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: int | torch.Tensor = 0,
        caches: list[KVCache] | None = None,
        memory_kv: list[KVCache] | None = None,
        need_weights: bool = False,
        key_positions: torch.Tensor | None = None,
        **layer_args,
    ) -> tuple[torch.Tensor, list[KVCache] | None, list]:
        """Run ``tokens (B, T)`` at ``positions`` (see :meth:`inputs`) through the stack.

        * ``caches``: per layer, the self-attention keys/values of the positions before ``tokens``
          (incremental decoding, from :meth:`empty_caches`); the grown ones are returned;
        * ``memory_kv``: per layer, the keys/values of the encoder output that its cross-attention
          reads (the decoder of the encoder–decoder), computed once per sentence;
        * ``layer_args`` go to every layer: ``mask`` and ``causal`` (:class:`~qkv.nn.layers.EncoderLayer`),
          ``memory_mask`` and ``beam`` (:class:`~qkv.nn.layers.DecoderLayer`);
        * ``key_positions``: with relative positions and ``caches``, the position of every key
          ``(B, T_past + T)`` where rows are at different points (default: ``0 .. T_past + T - 1``).

        Rotary and relative positions (a positional module with ``attention_inputs``) reach every
        layer's self-attention as ``rope`` / ``position_bias`` for these positions.

        Returns the final states ``(B, T, d)``, the grown caches (None without ``caches``) and each
        layer's attention weights (None unless ``need_weights``).
        """
        x = self.inputs(tokens, positions)
        if hasattr(self.pos, "attention_inputs"):
            layer_args.update(self.position_inputs(tokens, positions, caches, key_positions, x.dtype))
        grown, weights = [], []
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            if memory_kv is None:
                x, cache, w = layer(x, cache=cache, need_weights=need_weights, **layer_args)
            else:
                x, cache, w = layer(x, memory_kv[i], cache=cache, need_weights=need_weights, **layer_args)
            grown.append(cache)
            weights.append(w)
        return self.norm(x), (None if caches is None else grown), weights

    def position_inputs(self, tokens: torch.Tensor, positions: int | torch.Tensor, caches: list[KVCache] | None,
                        key_positions: torch.Tensor | None, dtype: torch.dtype) -> dict:
        """What a rotary or relative positional module gives the self-attentions for ``tokens (B, T)`` at
        ``positions`` (see :meth:`__call__`)."""
        t = tokens.size(1)
        if isinstance(positions, int):
            q = torch.arange(positions, positions + t, device=tokens.device)[None]  # (1, T)
        else:
            q = positions
        k = key_positions
        if k is None and caches is not None:  # the cached keys are the positions before: 0 .. T_past + T - 1
            k = torch.arange(caches[0].k.size(2) + t, device=tokens.device)[None]
        return self.pos.attention_inputs(q, k, dtype)

    def empty_caches(self, batch_size: int, like: torch.Tensor) -> list[KVCache]:
        """One self-attention cache of no positions per layer, to decode from."""
        return [layer.self_attn.empty_cache(batch_size, like) for layer in self.layers]

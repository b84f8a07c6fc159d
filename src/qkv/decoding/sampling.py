"""Sampling from a language model: temperature, top-k and top-p (nucleus) sampling.

At every step the next token is drawn from a reshaped next-token distribution:

* temperature T:  p_T(v) ∝ exp(z_v / T)   (T < 1 sharpens, T > 1 flattens; T → 0 is greedy,
  and ``temperature=0`` means exactly greedy: argmax);
* top-k (Fan et al., 2018): keep the k most probable tokens, renormalise;
* top-p (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration"): keep the
  smallest set V_p of most probable tokens with Σ_{v∈V_p} p(v) ≥ p, renormalise.

The filters are pure functions on logits (removed tokens get -inf), applied in the order
temperature, top-k, top-p. :func:`sample` runs any model with the incremental interface
(``start`` / ``step``, see :mod:`qkv.decoding.greedy`) and yields each token as it is drawn,
so a caller can print text as it is produced. A seed makes the draw reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from qkv.config import BOS, EOS
from qkv.decoding.greedy import NEVER_EMITTED, ban
from qkv.errors import ConfigError


MIN_TEMPERATURE = 1e-6  # below it, dividing float32 logits by the temperature overflows to inf


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``z / T`` for ``T >= MIN_TEMPERATURE``."""
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0 here (0 means greedy), got {temperature}")
    if temperature < MIN_TEMPERATURE:
        raise ConfigError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep exactly the ``k`` largest logits of each row ``(N, V)``; the rest become -inf (k=0: keep all).
    Ties at the boundary are broken by ``torch.topk``, so exactly k remain."""
    if k < 0:
        raise ConfigError(f"top_k must be >= 0, got {k}")
    if k == 0 or k >= logits.size(-1):
        return logits
    idx = logits.topk(k, dim=-1).indices  # (N, k)
    out = torch.full_like(logits, -math.inf)
    return out.scatter(-1, idx, logits.gather(-1, idx))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep, per row ``(N, V)``, the smallest set of most probable tokens whose mass is ≥ ``p``
    (p = 1: keep all). A token is kept when the mass of the tokens ranked above it is < p,
    so the most probable token is always kept."""
    if not 0 < p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {p}")
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V)
    probs = sorted_logits.float().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (N, V): mass of the tokens ranked above each
    keep_sorted = mass_before < p
    keep_sorted[..., 0] = True  # the most probable token, also where p rounds to 0 in float32
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # back to vocabulary order
    return logits.masked_fill(~keep, -math.inf)


def next_token(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    banned: Sequence[int] = NEVER_EMITTED,
) -> Tensor:
    """Draw one token per row from ``logits (N, V)`` -> ``(N,)``; ``temperature=0`` is greedy (argmax).
    The ``banned`` ids (special tokens, see :mod:`qkv.decoding.greedy`) are never drawn."""
    logits = ban(logits.float().clone(), banned)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(apply_temperature(logits, temperature), top_k), top_p)
    probs = logits.softmax(dim=-1)  # (N, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.inference_mode()
def sample(
    model,
    prefix: Sequence[int],
    max_new_tokens: int = 200,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_at_eos: bool = False,
    banned: Sequence[int] = NEVER_EMITTED,
) -> Iterator[int]:
    """Continue ``prefix`` (token ids) with up to ``max_new_tokens`` drawn tokens, yielding each
    as it is drawn. The prefix runs through the model once (``start`` on all but its last token,
    then ``step`` on the last); every later step feeds one token. An empty prefix starts from BOS.
    With ``stop_at_eos`` generation ends at EOS (not yielded); otherwise EOS is an ordinary token
    (in a text stream it marks the end of a line). ``banned``: ids never drawn
    (:func:`~qkv.decoding.greedy.banned_ids` of the model's tokenizer)."""
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    ids = list(prefix) or [BOS]
    state = model.start(torch.tensor([ids[:-1]], dtype=torch.long, device=device))  # (1, P - 1)
    token = torch.tensor([ids[-1]], dtype=torch.long, device=device)  # (1,)
    for _ in range(max_new_tokens):
        logits, state = model.step(token, state)
        token = next_token(logits, temperature, top_k, top_p, generator, banned)
        t = int(token)
        if stop_at_eos and t == EOS:
            return
        yield t

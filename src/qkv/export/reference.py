"""The checkpoint's own network in PyTorch, as the reference an exported model is checked against.

Every export ends by running a few fixed token sequences through both networks and comparing
(:func:`qkv.export.ct2.verify`, :func:`qkv.export.hf.verify`), so that a conversion that does not
match the checkpoint fails when it is made, not when it is used.
"""

from __future__ import annotations

import torch

from qkv.config import EOS, PAD
from qkv.data.batching import collate
from qkv.decoding.greedy import banned_ids
from qkv.export.source import Source
from qkv.models import build_model

PROBE_LENGTHS = ((5, 7), (9, 4), (1, 12))  # (source, target) tokens of each probe sequence
FIRST_ORDINARY = 7  # ids below are the specials (pad, unk, bos, eos) and, in monolingual models, <cls> [MASK] <sep>


def reference_model(src: Source) -> torch.nn.Module:
    """qkv's model for ``src``'s config with its weights, in eval mode."""
    model = build_model(src.model)
    model.load_state_dict(src.weights, strict=True)
    return model.eval()


def probe_sequences(src: Source) -> tuple[list[list[int]], list[list[int]]]:
    """Fixed pseudo-random (source, target) token ids of ordinary pieces (no specials), padded
    against each other in a batch: the same every time."""
    g = torch.Generator().manual_seed(0)

    def draw(n: int, vocab: int) -> list[int]:
        low = min(FIRST_ORDINARY, vocab - 1)
        return torch.randint(low, vocab, (n,), generator=g).tolist()

    sources = [draw(s, src.model.src_vocab_size) for s, _ in PROBE_LENGTHS]
    targets = [draw(t, src.model.tgt_vocab_size) for _, t in PROBE_LENGTHS]
    return sources, targets


@torch.inference_mode()
def translation_logits(model: torch.nn.Module, sources: list[list[int]], targets: list[list[int]]) -> torch.Tensor:
    """Teacher-forced logits ``(B, T + 1, V)`` of ``BOS target`` given ``source EOS`` (padded with PAD)."""
    batch = collate(sources, targets)
    return model(batch.src, batch.tgt_in).float()


@torch.inference_mode()
def lm_logits(model: torch.nn.Module, sequences: list[list[int]]) -> torch.Tensor:
    """Next-token logits ``(B, T, V)`` of right-padded ``sequences``."""
    width = max(len(s) for s in sequences)
    tokens = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    return model(tokens).float()


def reference_log_probs(src: Source, sources: list[list[int]], targets: list[list[int]],
                        never_emitted: float = -1e4) -> list[torch.Tensor]:
    """Per probe sequence, the log-probability of each target token and EOS (translation) or of each
    token after the first (language models, over ``source + target``), from logits with
    ``never_emitted`` added on the special tokens qkv never emits (:func:`qkv.decoding.banned_ids`), as the
    CTranslate2 export's output bias does."""
    model = reference_model(src)
    if src.task == "translate":
        logits = translation_logits(model, sources, targets)
        wanted = [t + [EOS] for t in targets]  # position j predicts wanted[j]
    else:
        seqs = [s + t for s, t in zip(sources, targets)]
        logits = lm_logits(model, seqs)
        wanted = [s[1:] for s in seqs]
    logits = logits.double()  # a copy outside inference mode
    logits[..., list(banned_ids(src.tokenizers.tgt))] += never_emitted
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i, torch.arange(len(w)), torch.tensor(w)] for i, w in enumerate(wanted)]


__all__ = ["reference_model", "probe_sequences", "translation_logits", "lm_logits", "reference_log_probs"]

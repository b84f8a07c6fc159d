"""Masked language modelling (Devlin et al., 2019, section 3.1): pretraining the encoder.

    input = <cls> x_1 .. x_n; choose each ordinary token with probability p = mask_prob (0.15);
    a chosen x_t is replaced by [MASK] with probability 0.8, by a random ordinary token with 0.1,
    and kept with 0.1; the model predicts the original x_t at the chosen positions only:

        loss = sum over chosen t of H(q_ls, softmax(model(input)_t))

Special pieces (PAD, BOS, EOS, <cls>, [MASK], <sep>) are never chosen; UNK may be. Every batch
has at least one chosen position. Training batches draw the masks from torch's global
generator (saved in checkpoints, so a resumed run repeats exactly); validation batches from a
generator seeded by the batch, so every validation sees the same masks.
best/ = lowest validation loss over the chosen positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.config import MASK, PAD, SEP, UNK, TrainConfig
from qkv.data.batching import Batch
from qkv.tasks.base import DataPaths, Task, TextData
from qkv.tasks.classify import encode_texts, encoder_input, read_text_data
from qkv.losses import label_smoothed_nll_loss

FIRST_ORDINARY = SEP + 1  # ids below this are special pieces (UNK excepted)
P_MASK, P_RANDOM = 0.8, 0.1  # of the chosen tokens; the remaining 0.1 stay unchanged


def mask_tokens(tokens: torch.Tensor, mask_prob: float, vocab_size: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption of ``tokens (B, T)`` -> (inputs ``(B, T)``, targets ``(B, T)``).

    ``targets`` holds the original token at the chosen positions and PAD elsewhere (PAD
    targets carry no loss). ``inputs`` is ``tokens`` with the chosen positions replaced.
    """
    candidates = (tokens >= FIRST_ORDINARY) | (tokens == UNK)  # (B, T)
    u = torch.rand(tokens.shape, generator=generator)
    chosen = candidates & (u < mask_prob)
    if not chosen.any() and candidates.any():  # at least one loss term per batch
        flat = candidates.flatten().nonzero().squeeze(1)
        pick = flat[torch.randint(len(flat), (1,), generator=generator)]
        chosen = chosen.flatten().index_fill(0, pick, True).view_as(tokens)
    action = torch.rand(tokens.shape, generator=generator)  # which replacement, per position
    random_ids = torch.randint(FIRST_ORDINARY, max(vocab_size, FIRST_ORDINARY + 1), tokens.shape, generator=generator)
    inputs = tokens.clone()
    inputs[chosen & (action < P_MASK)] = MASK
    swap = chosen & (action >= P_MASK) & (action < P_MASK + P_RANDOM)
    inputs[swap] = random_ids[swap]
    targets = torch.where(chosen, tokens, torch.full_like(tokens, PAD))
    return inputs, targets


@dataclass
class MaskedSplit:
    """Encoded texts; ``collate`` adds <cls> and masks (fresh masks per call when ``train``)."""

    ids: list[list[int]]
    texts: list[str]
    mask_prob: float
    vocab_size: int
    train: bool

    def __len__(self) -> int:
        return len(self.ids)

    def batches(self, max_tokens: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
        from qkv.data.batching import token_budget_batches

        return token_budget_batches([len(r) for r in self.ids], None, max_tokens, shuffle, seed, epoch)

    def collate(self, indices: list[int]) -> Batch:
        tokens = encoder_input([self.ids[i] for i in indices])  # (B, T)
        generator = None if self.train else torch.Generator().manual_seed(1_000_003 + min(indices))
        inputs, targets = mask_tokens(tokens, self.mask_prob, self.vocab_size, generator)
        return Batch(src=inputs, tgt_in=None, tgt_out=targets, indices=list(indices))


class MlmTask(Task):
    name = "mlm"
    offers = frozenset({"fill", "embed", "search", "viz"})
    kind = "a masked language model"
    stack = "encoder"
    frontend = "encoder"

    def read_data(self, paths: DataPaths, log):
        return read_text_data(paths, False, log, self.name)

    def encode(self, data: TextData, tokenizers, train_cfg: TrainConfig, log, train: bool) -> MaskedSplit:
        ids = encode_texts(data, tokenizers, train_cfg.max_len, log, self.name, train_cfg.keep_tail)
        keep = [i for i, row in enumerate(ids) if row]
        return MaskedSplit([ids[i] for i in keep], [data.texts[i] for i in keep], train_cfg.mask_prob,
                           tokenizers.src.vocab_size, train)

    def loss(self, module, batch: Batch, train_cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = batch.tgt_out != PAD  # (B, T)
        logits = module(batch.src, chosen)  # (N, V): the chosen positions only
        return label_smoothed_nll_loss(logits, batch.tgt_out[chosen], train_cfg.label_smoothing)

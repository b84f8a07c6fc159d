"""The prefix language model: translation by a decoder-only Transformer (Liu et al., 2018;
Raffel et al., 2020, section 3.2.1), which reads the source and continues it with the target.

    sequence  = x_1 .. x_n EOS <sep> BOS y_1 .. y_m EOS
    loss      = −Σ_{t=1..m+1} log p(y_t | x, <sep>, BOS, y_<t)        (y_{m+1} = EOS)

One causal stack reads source and target alike; the loss counts the target tokens (and the
final EOS) only: the targets at source positions are PAD, which the loss ignores, so the model
is not trained to generate sources. ``x EOS`` is exactly the source row of
:func:`qkv.data.batching.collate`, which decoding reads too: the model's ``start(src)`` appends
``<sep>`` and the first ``step`` is fed BOS (:class:`qkv.models.decoder_only.DecoderOnlyTransformer`),
so greedy and beam search (:mod:`qkv.decoding`) and :class:`qkv.frontends.Translator` work unchanged.

Validation: loss and perplexity over the target tokens, and BLEU / chrF / exact match of
greedy output on a sample, as for translation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.config import BOS, EOS, PAD, SEP, TrainConfig
from qkv.data.batching import token_budget_batches
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError
from qkv.tasks.lm import LMBatch
from qkv.tasks.translate import ParallelData, TranslateTask
from qkv.tasks.base import checkpoint_tokenizers, token_loss


def prefix_lm_example(src: list[int], tgt: list[int]) -> tuple[list[int], list[int]]:
    """``(inputs, targets)`` of one pair: the sequence ``src EOS <sep> BOS tgt EOS`` shifted by one,
    with PAD (no loss) as the target of every position before BOS."""
    seq = [*src, EOS, SEP, BOS, *tgt, EOS]
    inputs, targets = seq[:-1], seq[1:]
    n_prefix = len(src) + 2  # src EOS <sep>: their next tokens are not predicted
    targets = [PAD] * n_prefix + targets[n_prefix:]
    return inputs, targets


@dataclass
class PrefixLMSplit:
    """Encoded pairs as prefix-LM examples, batched by length under a token budget."""

    inputs: list[list[int]]
    targets: list[list[int]]
    raw_src: list[str]
    raw_tgt: list[str]
    metric: str = "bleu"  # the data's own validation metric (ParallelData.metric)

    def __len__(self) -> int:
        return len(self.inputs)

    def batches(self, max_tokens: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
        lengths = [len(x) for x in self.inputs]
        return token_budget_batches(lengths, lengths, max_tokens, shuffle, seed, epoch)

    def collate(self, indices: list[int]) -> LMBatch:
        t = max(len(self.inputs[i]) for i in indices)
        inputs = torch.full((len(indices), t), PAD, dtype=torch.long)  # (B, T), PAD on the right
        targets = torch.full((len(indices), t), PAD, dtype=torch.long)
        for row, i in enumerate(indices):
            inputs[row, : len(self.inputs[i])] = torch.tensor(self.inputs[i])
            targets[row, : len(self.targets[i])] = torch.tensor(self.targets[i])
        return LMBatch(inputs, targets)


class PrefixLmTask(TranslateTask):
    """Parallel data and BLEU as :class:`TranslateTask`; a decoder-only model over ``src <sep> tgt``."""

    name = "prefix_lm"
    stack = "decoder"
    specials = True  # <sep> at its fixed id

    def train_tokenizers(self, train_data: ParallelData, train_cfg: TrainConfig) -> TokenizerPair:
        if train_cfg.init_from:
            return checkpoint_tokenizers(train_cfg.init_from)
        # one vocabulary: source and target tokens share the one embedding of the one stack
        return TokenizerPair.train(*train_data.tokenizer_text(), train_cfg.vocab_size, train_cfg.tokenizer,
                                   True, specials=True)

    def model_config(self, model_cfg, tokenizers):
        if model_cfg.is_recurrent:
            raise QkvError(f"invalid config field 'arch': the prefix LM is a decoder-only Transformer, "
                           f"got {model_cfg.arch!r}")
        return super().model_config(model_cfg, tokenizers)

    def positions_needed(self, train_cfg: TrainConfig) -> int:
        """``src EOS <sep> BOS tgt``: two sides of up to max_len tokens and three specials."""
        return 2 * train_cfg.max_len + 3

    def encode(self, data: ParallelData, tokenizers, train_cfg: TrainConfig, log, train: bool) -> PrefixLMSplit:
        pairs = super().encode(data, tokenizers, train_cfg, log, train)  # over-long training pairs skipped
        examples = [prefix_lm_example(s, t) for s, t in zip(pairs.src_ids, pairs.tgt_ids)]
        return PrefixLMSplit([x for x, _ in examples], [y for _, y in examples], pairs.raw_src, pairs.raw_tgt,
                             pairs.metric)

    def loss(self, module, batch: LMBatch, train_cfg: TrainConfig):
        return token_loss(module, (batch.inputs,), batch.targets, train_cfg)  # logits (B, T, V)


__all__ = ["PrefixLmTask", "PrefixLMSplit", "prefix_lm_example"]

"""The language-model front-end run by CTranslate2: :class:`CT2LanguageModel`, a
:class:`~qkv.frontends.LanguageModel` whose generation is ``ctranslate2.Generator.generate_tokens``.

    >>> lm = qkv.load("runs/gpt2-import", engine="ctranslate2")
    >>> print("".join(lm.generate("the time traveller", 60, temperature=0)))

The prompt is qkv's (each line but the last ended by EOS, an empty prompt BOS; the last half-table
of a prompt longer than learned positions allow), and so is the stream (:meth:`LanguageModel.text_stream`):
EOS is a line break and generation goes on after it (no end token; an imported model reads its prompt
whole, as its tokenizer does, and its text ends at EOS), the special tokens qkv never emits are never drawn
(the conversion's output bias, :mod:`qkv.export.ct2`), and the text comes out in whole characters
(a byte-level tokenizer's token that ends inside a character is held back until the character is
complete). Greedy tokens (``temperature=0``) are qkv's; a sampled draw follows CTranslate2's random
generators, so it differs from qkv's draw for the same seed, and ``seed`` (``ctranslate2.set_random_seed``)
seeds them once per process: a command run again with the same ``--seed`` draws the same text, but two
calls in one process continue one random stream. :meth:`score` (perplexity) runs on qkv's engine: refused by name here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from qkv.config import BOS
from qkv.errors import QkvError
from qkv.frontends.language_model import LanguageModel


class CT2LanguageModel(LanguageModel):
    """A :class:`~qkv.frontends.LanguageModel` generating with ``ctranslate2.Generator`` (see the module).
    ``model``: the checkpoint's network on the meta device (its configuration and length rules)."""

    engine = "ctranslate2"

    def __init__(self, model, tokenizers, train_cfg, generator, directory: Path):
        super().__init__(model, tokenizers, train_cfg)
        self.ct2, self.directory = generator, directory
        from qkv.export.ct2 import pieces  # the conversion's vocabulary (its strings are CTranslate2's tokens)

        self.pieces = pieces(self.tokenizer)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def token_ids(self, prefix: str, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int | None = None) -> Iterator[int]:
        """The ids CTranslate2 draws after ``prefix`` (as :func:`qkv.decoding.sampling.sample` yields qkv's)."""
        from qkv.decoding.sampling import MIN_TEMPERATURE

        if max_new_tokens < 0:
            raise QkvError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature and temperature < MIN_TEMPERATURE:
            raise QkvError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")
        ids, max_new_tokens = self.fit_positions(self.prompt_ids(prefix), max_new_tokens)
        if max_new_tokens == 0:
            return
        if seed is not None:
            import ctranslate2

            ctranslate2.set_random_seed(seed)
        greedy = temperature == 0
        steps = self.ct2.generate_tokens(
            [self.pieces[i] for i in (list(ids) or [BOS])], max_length=max_new_tokens, min_length=0,
            sampling_topk=1 if greedy else top_k, sampling_topp=1.0 if greedy else top_p,
            sampling_temperature=1.0 if greedy else temperature, end_token=[])
        for n, step in enumerate(steps):
            yield int(step.token_id)
            if n + 1 >= max_new_tokens:
                break

    def generate(self, prefix: str, max_new_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None) -> Iterator[str]:
        """:meth:`LanguageModel.generate` with CTranslate2's tokens: the same text stream
        (:meth:`LanguageModel.text_stream`: whole characters; an imported model's text ends at EOS)."""
        ids, _ = self.fit_positions(self.prompt_ids(prefix), max_new_tokens)
        tokens = self.token_ids(prefix, max_new_tokens, temperature, top_k, top_p, seed)
        yield from self.text_stream(prefix, ids, tokens)

    def score(self, lines, max_tokens=None):
        raise QkvError("perplexity (qkv evaluate, score) runs on --engine qkv; --engine ctranslate2 generates")


def load_language_model(path: Path, directory: Path, model_cfg, train_cfg, device: tuple[str, int],
                        quantize: str | None, threads: int) -> CT2LanguageModel:
    """The lm Transformer at ``path`` with its conversion ``directory`` as a :class:`CT2LanguageModel`."""
    import ctranslate2

    from qkv.checkpoint import listed_files
    from qkv.data.tokenizer import TokenizerPair
    from qkv.models import build_model

    tokenizers = TokenizerPair.load(path, listed_files(path))
    with torch.device("meta"):  # the configuration and length rules; the weights live in CTranslate2
        model = build_model(model_cfg)
    name, index = device
    generator = ctranslate2.Generator(str(directory), device=name, device_index=index,
                                      compute_type="int8" if quantize else "default", intra_threads=threads)
    return CT2LanguageModel(model.eval(), tokenizers, train_cfg, generator, directory)


__all__ = ["CT2LanguageModel", "load_language_model"]

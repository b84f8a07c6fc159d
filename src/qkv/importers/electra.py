"""ELECTRA discriminators -> qkv's encoder-only model.

    ElectraModel                       task mlm without a head: embed, search
    ElectraForMaskedLM                 task mlm with the generator's tied head: fill, embed, search
    ElectraForSequenceClassification   task classify with its head and labels

An ELECTRA discriminator is BERT (:mod:`qkv.importers.bert`, the same names under ``electra.``) whose
embeddings may be narrower than the layers (``embedding_size``: qkv's ``embedding_dim``, projected to
d_model by ``embeddings_project``). Its classification head is ``classifier.dense`` with GELU and a dropout
before it (``pooler_activation = "gelu"``, ``pooler_dropout``), then ``classifier.out_proj``. The generator
(ElectraForMaskedLM) is ALBERT's masked-LM head: ``generator_predictions.dense`` maps d_model to the embedding
width, exact GELU whatever ``hidden_act`` says (``mlm_head_activation = "gelu"``), ``generator_predictions.LayerNorm``,
then ``generator_lm_head`` tied to the word embeddings with its bias. The discriminator's replaced-token head
(ElectraForPreTraining) scores each token real or replaced, a task qkv has not: refused by name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qkv.config import ModelConfig
from qkv.importers.bert import TOKEN_NAMES, Family, _state, convert_encoder, model_config as bert_config

ARCHITECTURES = ("ElectraModel", "ElectraForMaskedLM", "ElectraForSequenceClassification")
MODEL_TYPES = ("electra",)
DEFAULT_ARCHITECTURE = "ElectraModel"
#: architectures of the family refused with their reason
REFUSED = {"ElectraForPreTraining": "the discriminator's replaced-token head scores each token real or replaced, a "
                                    "task qkv has not; its encoder imports as ElectraModel or "
                                    "ElectraForSequenceClassification, the generator as ElectraForMaskedLM"}
HEADS = (("classifier.dense", "classifier.out_proj"),
         ("generator_predictions.dense", "generator_predictions.LayerNorm", "generator_lm_head.bias",
          "generator_lm_head"))


def model_config(c, where: Path, task: str, vocab_size: int) -> ModelConfig:
    mcfg = bert_config(c, where, task, vocab_size)
    width = c.int("embedding_size", mcfg.d_model, at_most=1 << 16)
    # the generator's head applies exact GELU (transformers' ElectraGeneratorPredictions), not hidden_act
    return replace(mcfg, embedding_dim=width if width != mcfg.d_model else 0, mlm_head_activation="gelu")


FAMILY = Family("ELECTRA", "electra.", {"ElectraForSequenceClassification": "classify"}, ("ElectraForMaskedLM",),
                TOKEN_NAMES,
                model_config, lambda w, cfg, ids, c: _state(w, cfg, ids, c, HEADS), "generator_lm_head.bias",
                {"pooler_activation": "gelu", "pooler_dropout": True})


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, FAMILY)

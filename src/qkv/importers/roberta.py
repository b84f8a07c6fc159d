"""RoBERTa-family encoders (RoBERTa, XLM-RoBERTa, CamemBERT) -> qkv's encoder-only model.

    RobertaModel (XLMRobertaModel, CamembertModel)          task mlm without its head: embed, search
    RobertaForMaskedLM (XLMRoberta.., Camembert..)          task mlm with its tied head: fill, embed, search
    RobertaForSequenceClassification (XLMRoberta.., ..)     task classify with its head and labels

RoBERTa is BERT (:mod:`qkv.importers.bert`) with one more switch: its learned positions start at row
``pad_token_id + 1`` = 2 of their table (``position_offset``; ``max_positions`` = the table's rows less
the offset, 512 of 514), as fairseq numbers them. Its classification head is BERT's pooler and classifier
with a dropout before the pooler too (``pooler_dropout``); its masked-LM head is BERT's, named ``lm_head``.
A text reads ``<s> tokens </s>`` (the tokenizer's RobertaProcessing, or a TemplateProcessing): ``<s>`` is
qkv's CLS. qkv writes a mask as ``[MASK]`` for every model; the tokenizer reads it as ``<mask>``.

Weights: ``roberta.`` + BERT's names; ``lm_head.{dense,layer_norm,bias}`` (the decoder tied to the word
embeddings); ``classifier.dense`` (qkv's pooler) and ``classifier.out_proj`` (qkv's classifier).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qkv.config import ModelConfig
from qkv.importers.bert import Family, _state, convert_encoder, model_config as bert_config, refuse

NAMES = ("Roberta", "XLMRoberta", "Camembert")
ARCHITECTURES = tuple(f"{n}{kind}" for n in NAMES for kind in ("Model", "ForMaskedLM", "ForSequenceClassification"))
MODEL_TYPES = ("roberta", "xlm-roberta", "camembert")
DEFAULT_ARCHITECTURE = "RobertaModel"
HEADS = (("classifier.dense", "classifier.out_proj"),
         ("lm_head.dense", "lm_head.layer_norm", "lm_head.bias", "lm_head.decoder"))


def model_config(c, where: Path, task: str, vocab_size: int) -> ModelConfig:
    """BERT's options and RoBERTa's positions: row t + pad_token_id + 1 of the table for position t
    (``c``: config.json, a :class:`~qkv.importers.folder.Config`)."""
    offset = c.int("pad_token_id", 1, at_least=0, at_most=1023) + 1
    rows = c.int("max_position_embeddings", 514, at_least=2)
    if rows <= offset + 1:
        refuse(where, f"max_position_embeddings {rows} leaves fewer than 2 positions after the first {offset} rows")
    return replace(bert_config({**c.data, "max_position_embeddings": rows - offset}, where, task, vocab_size),
                   position_offset=offset)


FAMILY = Family("RoBERTa", "roberta.", {f"{n}ForSequenceClassification": "classify" for n in NAMES},
                tuple(f"{n}ForMaskedLM" for n in NAMES),
                {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"},
                model_config, lambda w, cfg, ids, c: _state(w, cfg, ids, c, HEADS), "lm_head.bias",
                {"pooler_dropout": True})


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, FAMILY)

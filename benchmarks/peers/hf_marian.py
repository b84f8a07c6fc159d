"""Hugging Face transformers ``MarianMTModel`` configured as the paper's Transformer.

Post-norm layers (Marian's only layout), ReLU FFN, sinusoidal positions, embeddings scaled by
sqrt(d_model) and shared by encoder, decoder and the pre-softmax projection, dropout and attention
dropout as qkv's (activation dropout 0, as qkv). Attention: the library's default implementation
(``config._attn_implementation``, reported; sdpa where available).

Training: ``model(input_ids, attention_mask, decoder_input_ids)`` -> logits, then
``F.cross_entropy(label_smoothing, ignore_index=pad, reduction="sum")`` / target tokens, backward,
clip, Adam. Decoding: ``generate()`` with ``min_new_tokens = max_new_tokens = out_len``,
greedy or beam search (length_penalty alpha), under ``torch.inference_mode()``.
"""

from __future__ import annotations

import torch

from peers.common import decode_result, timed, train_result
from peers.torchutil import (adam, decode_src, flops, generic_train_step, smoothed_ce_sum, time_training,
                             train_batch)

EOS, UNK = 0, 1  # Marian's ids; PAD = decoder start = vocab - 1


def build(spec: dict):
    from transformers import MarianConfig, MarianMTModel

    m = spec["model"]
    v = m["vocab"]
    cfg = MarianConfig(
        vocab_size=v, decoder_vocab_size=v, d_model=m["d_model"],
        encoder_layers=m["layers"], decoder_layers=m["layers"],
        encoder_attention_heads=m["n_heads"], decoder_attention_heads=m["n_heads"],
        encoder_ffn_dim=m["d_ff"], decoder_ffn_dim=m["d_ff"], activation_function="relu",
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        max_position_embeddings=max(512, spec["train"]["tgt_len"], spec["decode"]["out_len"] + 1),
        dropout=m["dropout"], attention_dropout=m["attention_dropout"], activation_dropout=0.0,
        pad_token_id=v - 1, decoder_start_token_id=v - 1, eos_token_id=EOS, forced_eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = MarianMTModel(cfg)
    return model


def info(model) -> dict:
    import transformers

    return {"transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation}


def _train(spec: dict) -> dict:
    model = build(spec)
    pad = model.config.pad_token_id
    src, tgt_in, tgt_out = train_batch(spec, bos=model.config.decoder_start_token_id, eos=EOS)
    mask = (src != pad).long()
    eps = spec["train"]["label_smoothing"]

    def forward_loss():
        logits = model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in, use_cache=False).logits
        return smoothed_ce_sum(logits, tgt_out, pad, eps)

    opt = adam(model.parameters(), spec)
    step = generic_train_step(model, opt, forward_loss, int((tgt_out != pad).sum()), spec["train"]["clip_norm"])
    seconds = time_training(step, spec)
    n_params = sum(p.numel() for p in model.parameters())
    return train_result(spec, seconds, parameters=n_params, **info(model), **flops(spec))


def _decode(spec: dict, task: str) -> dict:
    d = spec["decode"]
    model = build(spec).eval()
    n = d["out_len"]
    kwargs = dict(do_sample=False, min_new_tokens=n, max_new_tokens=n, use_cache=True, num_return_sequences=1)
    if task == "greedy":
        kwargs.update(num_beams=1)
    else:
        kwargs.update(num_beams=d["beam_size"], length_penalty=d["length_penalty"], early_stopping=False)

    def run(src):
        out = model.generate(input_ids=src, attention_mask=torch.ones_like(src), **kwargs)
        assert out.shape == (src.size(0), n + 1), f"generate returned {tuple(out.shape)}, expected fixed lengths"

    with torch.inference_mode():
        run(decode_src(spec, EOS, n_rows=min(8, d["batch"])))  # warm-up
        src = decode_src(spec, EOS)
        seconds = timed(lambda: run(src), d["reps"])
    return decode_result(spec, task, seconds, **info(model))


def run(task: str, spec: dict, threads: int) -> dict:
    return _train(spec) if task == "train" else _decode(spec, task)


def convert_to_ct2(spec: dict, out_dir: str) -> dict:
    """Save the random-weight Marian model and convert it to CTranslate2 (float32 weights; int8
    is applied when loading with compute_type="int8"). Runs in its own (torch) process.

    The converter wants a tokenizer only for the vocabulary and the EOS/UNK tokens, so a minimal
    stand-in replaces ``AutoTokenizer``: ids 0 ``</s>``, 1 ``<unk>``, V-1 ``<pad>``, others ``w<id>``.
    (The converter drops Marian's last, ``<pad>``, entry: the CTranslate2 model has V-1 tokens and
    starts the decoder from a zero embedding, as Marian does.)
    """
    import os
    import tempfile

    from ctranslate2.converters import TransformersConverter

    model = build(spec)
    v = model.config.vocab_size
    vocab = {ct2_token(i, v): i for i in range(v)}

    class Tok:
        eos_token, unk_token, bos_token = "</s>", "<unk>", None
        special_tokens_map: dict = {}

        def get_vocab(self):
            return dict(vocab)

        def convert_ids_to_tokens(self, i):
            return ct2_token(i, v)

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return Tok()

    with tempfile.TemporaryDirectory() as hf_dir:
        model.save_pretrained(hf_dir)
        Converter(hf_dir).convert(out_dir, force=True)
    return {"task": "convert", "ct2_dir": out_dir, "files": sorted(os.listdir(out_dir))}


def ct2_token(i: int, vocab: int) -> str:
    return {0: "</s>", 1: "<unk>", vocab - 1: "<pad>"}.get(i, f"w{i}")

"""qkv itself: training through ``qkv.training.trainer.Trainer.train_step`` (the code ``qkv train``
runs: qkv's label-smoothed loss, gradient clipping at the preset's clip_norm, Adam(0.9, 0.98, 1e-9),
the noam learning rate), decoding through ``qkv.decoding.greedy`` / ``beam_search`` on token
tensors (what ``qkv.frontends.Translator`` calls after tokenizing; tokenization is left out for every
system)."""

from __future__ import annotations

import inspect
import tempfile
import types
from dataclasses import fields, replace
from pathlib import Path

import torch

from peers.common import decode_result, timed, train_result
from peers.torchutil import decode_src, flops, time_training, train_batch


def model_config(spec: dict):
    from qkv.config import ModelConfig

    m = spec["model"]
    return ModelConfig(
        d_model=m["d_model"], n_heads=m["n_heads"], d_ff=m["d_ff"], n_encoder_layers=m["layers"],
        n_decoder_layers=m["layers"], dropout=m["dropout"], attention_dropout=m["attention_dropout"],
        src_vocab_size=m["vocab"], tgt_vocab_size=m["vocab"], share_embeddings=True, tie_output=True,
    ).validate()


def _train(spec: dict) -> dict:
    from qkv.config import BOS, EOS, DecodeConfig, TrainConfig
    from qkv.data.batching import Batch
    from qkv.training.trainer import Trainer

    cfg = model_config(spec)
    vocab = types.SimpleNamespace(vocab_size=cfg.src_vocab_size)
    tokenizers = types.SimpleNamespace(src=vocab, tgt=vocab, joint=True)
    # TrainConfig's defaults (no torch.compile, no mixed precision, on the CPU where they exist):
    # what `qkv train` runs unless told otherwise.
    over = {"label_smoothing": spec["train"]["label_smoothing"], "clip_norm": spec["train"]["clip_norm"]}
    if "device" in {f.name for f in fields(TrainConfig)}:
        over["device"] = "cpu"
    train_cfg = replace(TrainConfig(), **over).validate()
    src, tgt_in, tgt_out = train_batch(spec, BOS, EOS)
    batch = Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, indices=list(range(src.size(0))))
    split = types.SimpleNamespace(collate=lambda indices: batch)  # the trainer's split: always this batch
    # train_step takes a group of batches, or (newer trainers) a group of index lists it collates
    group_of = str(inspect.signature(Trainer.train_step).parameters["group"].annotation)
    group = [list(range(src.size(0)))] if "int" in group_of else [batch]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, train_cfg, DecodeConfig(), tokenizers, split, None, Path(tmp), log=lambda m: None)
        seconds = time_training(lambda: trainer.train_step(group), spec)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    settings = {k: getattr(train_cfg, k) for k in ("amp", "compile") if hasattr(train_cfg, k)}
    return train_result(spec, seconds, parameters=n_params, step_path="Trainer.train_step", train_settings=settings,
                        **flops(spec))


def _decode(spec: dict, task: str, int8: bool = False) -> dict:
    from qkv.config import EOS
    from qkv.decoding import beam_search, greedy
    from qkv.models import build_model

    d = spec["decode"]
    torch.manual_seed(0)
    model = build_model(model_config(spec)).eval()
    if int8:  # dynamic int8 quantisation, as `qkv translate --int8`
        from qkv.frontends import quantize_int8

        model = quantize_int8(model)
    # min_len = max_len = out_len - 1: every sentence emits out_len - 1 tokens, then the forced EOS,
    # so every batch row runs exactly out_len decoder steps (as the peers' out_len new tokens).
    n = d["out_len"] - 1

    def run(src):
        if task == "greedy":
            out = greedy(model, src, n, min_len=n)
            assert all(len(o) == n for o in out), "greedy: output lengths are not fixed"
        else:
            out = beam_search(model, src, d["beam_size"], d["length_penalty"], n, nbest=1, min_len=n)
            assert all(len(h[0].tokens) == n for h in out), "beam: output lengths are not fixed"

    with torch.inference_mode():
        run(decode_src(spec, EOS, n_rows=min(8, d["batch"])))  # warm-up
        src = decode_src(spec, EOS)
        seconds = timed(lambda: run(src), d["reps"])
    return decode_result(spec, task, seconds, decode_path=f"qkv.decoding.{'greedy' if task == 'greedy' else 'beam_search'}")


def run(task: str, spec: dict, threads: int, int8: bool = False) -> dict:
    return _train(spec) if task == "train" else _decode(spec, task, int8)

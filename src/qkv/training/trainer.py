"""The training loop, written once for every architecture (section 5).

* teacher forcing: the decoder reads the target shifted right (BOS + y) and predicts y + EOS;
* label-smoothed cross-entropy over non-padding target tokens (:mod:`qkv.training.loss`);
* Adam(β1=0.9, β2=0.98, ε=1e-9) with the warmup schedule (:mod:`qkv.training.schedule`);
* gradient clipping, gradient accumulation (``update_freq``);
* length-bucketed batches under a token budget (:mod:`qkv.data.batching`);
* periodic validation: loss, perplexity, BLEU (and exact match) of greedy output on a sample;
* checkpoints ``last/`` and ``best/`` (lowest validation loss), written atomically, and ``--resume``
  that continues exactly where a run stopped: weights, optimizer, step, position in the epoch's
  batch order and the RNG state are all restored;
* a progress bar with loss, learning rate and tokens/s; every record appended to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from qkv.config import DecodeConfig, ModelConfig, TrainConfig, to_dict
from qkv.data.batching import Batch, collate, token_budget_batches
from qkv.data.corpus import CorpusReport, filter_by_length
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError
from qkv.metrics import bleu, chrf, exact_match
from qkv.models import build_model
from qkv.training.checkpoint import list_checkpoints, load_into, read_checkpoint, save_checkpoint, step_path
from qkv.training.loss import label_smoothed_nll_loss
from qkv.training.schedule import noam


@dataclass
class ParallelData:
    """Sentence pairs for one split, as raw text (tokenized by the trainer)."""

    src: list[str]
    tgt: list[str]
    name: str = "data"
    line_numbers: list[int] | None = None
    report: CorpusReport | None = None


@dataclass
class EncodedSplit:
    src_ids: list[list[int]]
    tgt_ids: list[list[int]]
    raw_src: list[str]
    raw_tgt: list[str]

    def batches(self, max_tokens: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
        return token_budget_batches(
            [len(s) for s in self.src_ids], [len(t) for t in self.tgt_ids], max_tokens, shuffle, seed, epoch
        )

    def collate(self, indices: list[int]) -> Batch:
        return collate([self.src_ids[i] for i in indices], [self.tgt_ids[i] for i in indices])


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    valid: dict = field(default_factory=dict)


def _log_stderr(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


class Trainer:
    """Owns the model, the optimizer and the loop; the public entry point is :func:`train`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        decode_cfg: DecodeConfig,
        tokenizers: TokenizerPair,
        train_split: EncodedSplit,
        valid_split: EncodedSplit | None,
        out_dir: Path,
        log: Callable[[str], None] = _log_stderr,
        data_name: str = "data",
    ):
        self.train_cfg, self.decode_cfg = train_cfg, decode_cfg
        self.model_cfg = replace(
            model_cfg,
            src_vocab_size=tokenizers.src.vocab_size,
            tgt_vocab_size=tokenizers.tgt.vocab_size,
            share_embeddings=model_cfg.share_embeddings and tokenizers.joint,
        ).validate()
        self.tokenizers = tokenizers
        self.train_split, self.valid_split = train_split, valid_split
        self.out_dir, self.log = out_dir, log
        torch.manual_seed(train_cfg.seed)
        self.model = build_model(self.model_cfg)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(),
            lr=0.0,
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            eps=train_cfg.adam_eps,
            weight_decay=train_cfg.weight_decay,
        )
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of the current epoch already consumed
        self.best_valid_loss = math.inf
        self.elapsed = 0.0  # seconds of training over all sessions of this run
        self.metrics_path = out_dir / "metrics.jsonl"
        self.data_name = data_name  # what the run trains on (recorded in the checkpoint's config)

    # --- state ---------------------------------------------------------------------------------------

    def config_dict(self) -> dict:
        return {"model": to_dict(self.model_cfg), "train": to_dict(self.train_cfg), "decode": to_dict(self.decode_cfg),
                "data": {"train": self.data_name}}

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "best_valid_loss": self.best_valid_loss,
            "elapsed": self.elapsed,
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def save(self, name: str) -> Path:
        path = self.out_dir / name
        save_checkpoint(path, self.model, self.config_dict(), write_extra=self.tokenizers.save,
                        trainer_state=self.trainer_state())
        return path

    def save_numbered(self) -> None:
        """``step_NNNNNN/`` checkpoints (for averaging), keeping the newest ``keep_last``."""
        keep = self.train_cfg.keep_last
        if keep <= 0:
            return
        self.save(step_path(self.out_dir, self.step).name)
        for old in list_checkpoints(self.out_dir)[:-keep]:
            shutil.rmtree(old)

    def restore(self, path: Path) -> None:
        ckpt = read_checkpoint(path, need_trainer_state=True)
        if ckpt.trainer_state is None:
            raise QkvError(f"{path}: checkpoint has no trainer_state.pt, so training cannot resume from it")
        load_into(self.model, ckpt)
        st = ckpt.trainer_state
        self.optimizer.load_state_dict(st["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = int(st["step"]), int(st["epoch"]), int(st["batch_in_epoch"])
        self.best_valid_loss, self.elapsed = float(st["best_valid_loss"]), float(st["elapsed"])
        torch.set_rng_state(st["torch_rng"])

    def record(self, entry: dict) -> None:
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")

    # --- the loop ------------------------------------------------------------------------------------

    def lr(self, step: int) -> float:
        c = self.train_cfg
        return noam(step, self.model_cfg.d_model, c.warmup_steps, c.lr_scale)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(batch.src, batch.tgt_in)  # (B, T, V)
        return label_smoothed_nll_loss(logits, batch.tgt_out, self.train_cfg.label_smoothing)

    def _stop_reason(self, started: float) -> str | None:
        c = self.train_cfg
        if self.step >= c.max_steps:
            return f"reached max_steps={c.max_steps}"
        if c.max_epochs and self.epoch >= c.max_epochs:
            return f"reached max_epochs={c.max_epochs}"
        if c.max_time and self.elapsed + (time.perf_counter() - started) >= c.max_time:
            return f"reached max_time={c.max_time:g}s"
        return None

    def _batches(self):
        """Yield groups of ``update_freq`` batches, resuming mid-epoch where the state says."""
        c = self.train_cfg
        while True:
            order = self.train_split.batches(c.max_tokens, shuffle=True, seed=c.seed, epoch=self.epoch)
            while self.batch_in_epoch < len(order):
                group = order[self.batch_in_epoch : self.batch_in_epoch + c.update_freq]
                self.batch_in_epoch += len(group)
                yield [self.train_split.collate(ix) for ix in group]
            self.epoch += 1
            self.batch_in_epoch = 0
            if c.max_epochs and self.epoch >= c.max_epochs:
                return

    def train_step(self, group: list[Batch]) -> dict:
        """One optimizer update over ``update_freq`` batches; the loss is normalised per target token."""
        self.model.train()
        n_tokens = sum(b.n_tgt_tokens for b in group)
        loss_sum = nll_sum = 0.0
        for batch in group:
            loss, nll = self.loss(batch)
            (loss / n_tokens).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
        self.step += 1
        lr = self.lr(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        grad_norm = None
        if self.train_cfg.clip_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.clip_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum / n_tokens, "nll": nll_sum / n_tokens, "lr": lr, "tokens": n_tokens,
                "grad_norm": grad_norm}

    @torch.no_grad()
    def validate(self) -> dict:
        """Validation loss and perplexity over the whole split; BLEU/exact match of greedy output on a sample."""
        split = self.valid_split
        assert split is not None
        self.model.eval()
        loss_sum = nll_sum = n_tokens = 0.0
        for ix in split.batches(self.train_cfg.max_tokens, shuffle=False, seed=0, epoch=0):
            batch = split.collate(ix)
            loss, nll = self.loss(batch)
            loss_sum, nll_sum, n_tokens = loss_sum + loss.item(), nll_sum + nll.item(), n_tokens + batch.n_tgt_tokens
        out = {"valid_loss": loss_sum / n_tokens, "valid_nll": nll_sum / n_tokens,
               "valid_ppl": math.exp(min(nll_sum / n_tokens, 50.0))}
        n = min(self.train_cfg.eval_bleu_samples, len(split.raw_src))
        if n > 0:
            from qkv.api import Translator  # the same decoding code users run

            translator = Translator(self.model, self.tokenizers, replace(self.decode_cfg, beam_size=1, nbest=1))
            hyps = translator.translate(split.raw_src[:n])
            refs = split.raw_tgt[:n]
            out["valid_bleu"] = bleu(hyps, refs).score
            out["valid_chrf"] = chrf(hyps, refs).score
            out["valid_exact"] = exact_match(hyps, refs)
            out["valid_samples"] = [[s, h, r] for s, h, r in zip(split.raw_src[:3], hyps[:3], refs[:3])]
        return out

    def _validate_and_save(self, bar: tqdm | None) -> dict:
        record: dict = {"step": self.step, "epoch": self.epoch}
        if self.valid_split is not None and len(self.valid_split.src_ids) > 0:
            v = self.validate()
            samples = v.pop("valid_samples", [])
            record.update(v)
            improved = v["valid_loss"] < self.best_valid_loss
            if improved:
                self.best_valid_loss = v["valid_loss"]
            msg = (f"step {self.step}: valid loss {v['valid_loss']:.3f}  ppl {v['valid_ppl']:.2f}"
                   + (f"  BLEU {v['valid_bleu']:.2f}  chrF {v['valid_chrf']:.2f}  exact {100 * v['valid_exact']:.1f}%"
                      if "valid_bleu" in v else "")
                   + ("  (best)" if improved else ""))
            self.log(msg)
            for s, h, r in samples[:1]:
                self.log(f"  src: {s}\n  hyp: {h}\n  ref: {r}")
            self.record(record)
            self.save("last")
            if improved:
                self.save("best")
            self.save_numbered()
        else:
            self.record(record)
            self.save("last")
            self.save("best")
            self.save_numbered()
        return record

    def run(self) -> TrainResult:
        c = self.train_cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        bar = tqdm(total=c.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not sys.stderr.isatty(), file=sys.stderr)
        window_tokens, window_start = 0, time.perf_counter()
        last_record: dict = {}
        reason = self._stop_reason(started)
        try:
            for group in self._batches() if reason is None else ():
                stats = self.train_step(group)
                window_tokens += stats["tokens"]
                now = time.perf_counter()
                tok_s = window_tokens / max(now - window_start, 1e-9)
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}", tok_s=f"{tok_s:,.0f}")
                if self.step % 50 == 0 or self.step == 1:
                    self.record({"step": self.step, "epoch": self.epoch, "train_loss": stats["loss"],
                                 "train_nll": stats["nll"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                                 "tokens_per_s": tok_s})
                    window_tokens, window_start = 0, now
                reason = self._stop_reason(started)
                if reason or self.step % c.eval_every == 0:
                    self.elapsed += time.perf_counter() - started
                    started = time.perf_counter()
                    last_record = self._validate_and_save(bar)
                if reason:
                    break
            else:
                if reason is None:
                    reason = f"reached max_epochs={c.max_epochs}"
                    self.elapsed += time.perf_counter() - started
                    last_record = self._validate_and_save(bar)
        except KeyboardInterrupt:
            self.elapsed += time.perf_counter() - started
            self.log(f"interrupted at step {self.step}: saving {self.out_dir / 'last'} (resume with --resume)")
            self.save("last")
            bar.close()
            raise
        bar.close()
        self.log(f"stopped: {reason}; checkpoints in {self.out_dir}/last and {self.out_dir}/best")
        return TrainResult(self.out_dir, self.step, last_record)


def encode_split(data: ParallelData, tokenizers: TokenizerPair, max_len: int | None, log) -> EncodedSplit:
    """Tokenize a split; with ``max_len``, drop over-long pairs and report how many (with line numbers)."""
    src_ids = tokenizers.src.encode(data.src)
    tgt_ids = tokenizers.tgt.encode(data.tgt)
    keep = list(range(len(src_ids)))
    if max_len is not None:
        report = data.report or CorpusReport(paths=[data.name], n_lines=len(src_ids))
        lines = data.line_numbers or list(range(1, len(src_ids) + 1))
        keep = filter_by_length(src_ids, tgt_ids, max_len, lines, report)
        if len(keep) < len(src_ids):
            log(f"{data.name}: skipped {len(src_ids) - len(keep)} pair(s) longer than max_len={max_len} tokens")
    return EncodedSplit([src_ids[i] for i in keep], [tgt_ids[i] for i in keep],
                        [data.src[i] for i in keep], [data.tgt[i] for i in keep])


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    decode_cfg: DecodeConfig,
    train_data: ParallelData,
    valid_data: ParallelData | None,
    out_dir: str | Path,
    resume: bool = False,
    log: Callable[[str], None] = _log_stderr,
) -> TrainResult:
    """Train a model on ``train_data``; validate on ``valid_data``; checkpoints under ``out_dir``.

    With ``resume``, the configs, the tokenizer and the whole training state come from
    ``out_dir/last`` and training continues to the (possibly raised) ``max_steps``.
    """
    train_cfg.validate()
    decode_cfg.validate()
    model_cfg.validate()
    out_dir = Path(out_dir)
    if train_cfg.threads:
        torch.set_num_threads(train_cfg.threads)
    if not train_data.src:
        raise QkvError(f"{train_data.name}: no training pairs left to train on")
    last = out_dir / "last"
    if resume:
        if not last.exists():
            raise QkvError(f"cannot resume: {last} does not exist (train without --resume first)")
        tokenizers = TokenizerPair.load(last)
    else:
        if last.exists():
            raise QkvError(f"{out_dir} already holds a run ({last}); pass --resume to continue it or choose another --out")
        log(f"training a {train_cfg.tokenizer} tokenizer ({'joint' if train_cfg.joint_vocab else 'separate'} "
            f"vocabulary, up to {train_cfg.vocab_size} pieces) on {len(train_data.src)} pairs")
        tokenizers = TokenizerPair.train(train_data.src, train_data.tgt, train_cfg.vocab_size,
                                         train_cfg.tokenizer, train_cfg.joint_vocab)
    train_split = encode_split(train_data, tokenizers, train_cfg.max_len, log)
    if not train_split.src_ids:
        raise QkvError(f"{train_data.name}: every pair is longer than max_len={train_cfg.max_len}")
    valid_split = encode_split(valid_data, tokenizers, None, log) if valid_data is not None else None
    trainer = Trainer(model_cfg, train_cfg, decode_cfg, tokenizers, train_split, valid_split, out_dir, log,
                      data_name=train_data.name)
    if resume:
        trainer.restore(last)
        # The run continues under the saved settings, except where the user raised a limit.
        log(f"resuming from {last} at step {trainer.step} (epoch {trainer.epoch})")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log(f"model: {trainer.model_cfg.arch}, {n_params:,} parameters; "
        f"{len(train_split.src_ids)} training pairs, {len(valid_split.src_ids) if valid_split else 0} validation pairs")
    return trainer.run()

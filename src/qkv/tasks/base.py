"""The task interface (documented in :mod:`qkv.tasks`), its defaults, and the data containers."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data.labelled import TextData  # noqa: F401  (the tasks' one-sided data; defined with its readers)
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import ConfigError, QkvError
from qkv.losses import label_smoothed_nll_loss, linear_label_smoothed_nll_loss


@dataclass
class DataPaths:
    """The data files named on the command line (each task reads the ones it needs); built by keyword only
    (a field added in the middle must not shift the others)."""

    _: KW_ONLY
    train: str | None = None  # one-sided tasks: text (mlm, lm) or labelled text (classify)
    valid: str | None = None
    src_train: str | None = None  # parallel tasks: translate, prefix_lm
    tgt_train: str | None = None
    src_valid: str | None = None
    tgt_valid: str | None = None
    text_field: str = "text"  # JSONL key / TSV column of the text
    label_field: str = "label"  # JSONL key / TSV column of the label (classify)
    strip_gutenberg: bool = False  # lm: keep only the book between the "*** START" and "*** END" lines
    valid_fraction: float = 0.0  # lm: without a valid file, hold out this last fraction of the training text
    clean_html: bool = True  # classify, mlm: <br /> -> space in the texts (TrainConfig.clean_html)
    data: str | None = None  # translate: a directory written by qkv preprocess (instead of the text files)
    verify_data: bool = True  # check its files' checksums (a resumed run checks their sizes only)


class Task:
    """Defaults shared by the tasks; each task module overrides what differs."""

    name = "task"
    data_kind = "text"  # "parallel" or "text"
    specials = True
    best_metric, best_mode = "valid_loss", "min"
    unit = "tok"  # what n_tgt_tokens counts, for the progress line ("tok/s", "ex/s")
    # What its checkpoints serve: the qkv commands (translate, evaluate, classify, fill, embed, search,
    # generate, viz, ensemble) that take a model of this task; and the model's name in messages.
    offers: frozenset[str] = frozenset()
    kind = "a model"
    stack = "encoder-decoder"  # the Transformer it trains: encoder-decoder | encoder | decoder
    frontend = "translator"  # what qkv.load returns for its checkpoints: translator | encoder | language_model

    def read_data(self, paths: DataPaths, log: Callable[[str], None]):
        raise NotImplementedError

    def check_data(self, train_data, valid_data, saved: dict | None) -> None:
        if len(train_data) == 0:
            raise QkvError(f"{train_data.name}: no training examples to train on")

    def training_texts(self, train_data) -> list[str]:
        """What the tokenizer learns from."""
        return list(train_data.texts)

    def train_tokenizers(self, train_data, train_cfg: TrainConfig) -> TokenizerPair:
        if train_cfg.init_from:  # the start checkpoint's own vocabulary: its embeddings index it
            return checkpoint_tokenizers(train_cfg.init_from)
        texts = self.training_texts(train_data)
        return TokenizerPair.train(texts, texts, train_cfg.vocab_size, train_cfg.tokenizer, True, specials=self.specials)

    def model_config(self, model_cfg: ModelConfig, tokenizers: TokenizerPair) -> ModelConfig:
        v = tokenizers.src.vocab_size
        return replace(model_cfg, src_vocab_size=v, tgt_vocab_size=tokenizers.tgt.vocab_size,
                       share_embeddings=model_cfg.share_embeddings and tokenizers.joint)

    def positions_needed(self, train_cfg: TrainConfig) -> int:
        """The longest sequence one training example puts through the model, in positions: a
        ``max_len`` text (or side) and the special token this task adds to it (EOS after a source,
        BOS before a target, ``<cls>`` before a text)."""
        return train_cfg.max_len + 1

    def check_positions(self, model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
        """Learned positions end at ``max_positions``, which must cover :meth:`positions_needed`
        (sinusoidal ones and recurrent models have no such end)."""
        if model_cfg.positional == "learned" and not model_cfg.is_recurrent:
            require_positions(model_cfg, train_cfg, self.positions_needed(train_cfg),
                              f"learned positions end at max_positions={model_cfg.max_positions}")

    def state(self) -> dict[str, Any]:
        return {}

    def encode(self, data, tokenizers: TokenizerPair, train_cfg: TrainConfig, log, train: bool):
        raise NotImplementedError

    def loss(self, module: torch.nn.Module, batch, train_cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, model, split, tokenizers: TokenizerPair, decode_cfg: DecodeConfig, train_cfg: TrainConfig) -> dict:
        return {}

    def summary(self, record: dict) -> str:
        return ""


#: Where ``fused_loss`` fuses the output projection into the loss. On the CPU the chunked pass keeps
#: the logits in cache and is faster; on an H100 making the logits was faster (the base model's bf16
#: update: 72.7 ms against 94.9 ms fused, benchmarks/gpu_train.py), so a GPU makes them.
FUSED_LOSS_DEVICES = ("cpu",)


def token_loss(module: torch.nn.Module, inputs: tuple, target: torch.Tensor, train_cfg: TrainConfig,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, nll_sum) of a model that maps ``inputs`` to next-token logits ``(B, T, V)``.

    With ``train_cfg.fused_loss``, on a device of :data:`FUSED_LOSS_DEVICES` (the CPU) and a model
    that exposes ``output_weight`` (the Transformers), the model returns its final states
    (``features=True``) and the output projection runs inside :func:`linear_label_smoothed_nll_loss`,
    which never makes the full logits; otherwise the loss is taken from the logits. Both give the same
    values and gradients (to float rounding). ``module`` may be wrapped (DDP, torch.compile): it is
    called, the weight is read from inside. Traced by ``torch.compile`` (a compiled training step,
    :mod:`qkv.training.step`), the loss is taken from the logits, which the compiler fuses.
    """
    model = unwrap(module)
    if train_cfg.fused_loss and target.device.type in FUSED_LOSS_DEVICES and hasattr(model, "output_weight") \
            and getattr(model, "output_bias", None) is None \
            and not torch.compiler.is_compiling():  # its chunk loop and nonzero are eager code; no bias term
        hidden = module(*inputs, features=True)  # (B, T, d)
        return linear_label_smoothed_nll_loss(hidden, model.output_weight, target, train_cfg.label_smoothing)
    return label_smoothed_nll_loss(module(*inputs), target, train_cfg.label_smoothing)


def require_positions(model_cfg: ModelConfig, train_cfg: TrainConfig, need: int, why: str) -> None:
    """A ConfigError naming max_positions and max_len when ``max_positions < need``."""
    if model_cfg.max_positions < need:
        raise ConfigError(f"invalid config field 'max_positions': {why}, but a {model_cfg.task} example of "
                          f"max_len={train_cfg.max_len} tokens takes {need} positions: set max_positions to at "
                          f"least {need}, or lower max_len")


# --- starting from another checkpoint ------------------------------------------------------------------

ARCH_FIELDS = ("arch", "d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers", "positional",
               "max_positions", "norm_first", "share_embeddings", "tie_output", "activation", "layer_norm_eps",
               "scale_embeddings", "type_vocab_size", "embedding_norm", "final_norm",
               "sinusoid_layout", "output_bias", "position_offset", "embedding_dim", "layer_groups",
               "mlm_head_activation", "rope_theta", "relative_buckets", "relative_max_distance", "norm", "norm_bias",
               "ffn_gated", "ffn_bias", "n_kv_heads", "qkv_bias", "out_bias", "attention_scale")


#: a classifier's head, which a classifier started from it keeps: where it pools, its pooler, and the pooler's
#: activation and dropout (the family's: ELECTRA's GELU head, BERT's tanh pooler)
CLASSIFIER_FIELDS = ("pooling", "pooler", "pooler_activation", "pooler_dropout")


def checkpoint_tokenizers(path: str | Path) -> TokenizerPair:
    """The tokenizer of the checkpoint at ``path``: the model files its manifest lists, no other."""
    from qkv.checkpoint import listed_files

    return TokenizerPair.load(path, listed_files(path))


def init_model_config(model_cfg: ModelConfig, path: str | Path, log: Callable[[str], None]) -> ModelConfig:
    """The architecture of the checkpoint at ``path`` (its weights must fit), this run's task and the rest."""
    from qkv.checkpoint import read_checkpoint, read_config

    saved = read_config(read_checkpoint(Path(path)), "model")
    fields = ARCH_FIELDS + (CLASSIFIER_FIELDS if saved.task == model_cfg.task == "classify" else ())
    changed = {k: getattr(saved, k) for k in fields if getattr(saved, k) != getattr(model_cfg, k)}
    if changed:
        log(f"init_from {path}: its architecture wins over this run's: "
            + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
    return replace(model_cfg, **{k: getattr(saved, k) for k in fields})


def init_positions(task: "Task", model_cfg: ModelConfig, train_cfg: TrainConfig, path: str | Path,
                   log: Callable[[str], None]) -> TrainConfig:
    """``train_cfg`` with ``max_len`` lowered to what the learned (or rotary) positions of the checkpoint at
    ``path`` hold (its architecture, ``max_positions`` included, wins: an import of 64 learned positions trains
    on texts of at most 63 tokens, a Llama import of a 128-token context on windows of at most 128), said in the
    log; unchanged when they hold ``max_len`` already. Rotary positions have no table that ends, but the model
    was trained within ``max_positions`` (an import's max_position_embeddings): training beyond it is not
    continuing that model."""
    if model_cfg.positional not in ("learned", "rotary") or model_cfg.is_recurrent:
        return train_cfg
    over = task.positions_needed(train_cfg) - model_cfg.max_positions
    if over <= 0:
        return train_cfg
    kind = model_cfg.positional
    if train_cfg.max_len - over < 1:
        raise ConfigError(f"init_from {path}: its {kind} positions (max_positions={model_cfg.max_positions}) "
                          f"hold no {model_cfg.task} example")
    fitted = replace(train_cfg, max_len=train_cfg.max_len - over,
                     keep_tail=min(train_cfg.keep_tail, train_cfg.max_len - over - 1))
    log(f"init_from {path}: max_len {fitted.max_len} (not {train_cfg.max_len}): its {kind} positions end at "
        f"max_positions={model_cfg.max_positions}")
    return fitted.validate()


def init_weights(model: torch.nn.Module, path: str | Path, log: Callable[[str], None],
                 labels: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Copy every parameter of the checkpoint at ``path`` whose name and shape match ``model``'s.

    Returns (copied names, names left at their fresh initialisation), e.g. an MLM encoder's
    embeddings and layers copied into a classifier whose head stays new. A classifier's output rows
    (``classifier.*``) are copied only when the checkpoint has this run's ``labels`` in the same
    order: rows of other labels, or of the same in another order, would score the wrong classes.
    """
    from qkv.checkpoint import read_checkpoint

    ckpt = read_checkpoint(Path(path))
    own = model.state_dict()
    copied, fresh = [], []
    other_labels = labels is not None and ckpt.config.get("labels") != labels
    if other_labels and any(n.startswith("classifier.") for n in ckpt.state_dict):
        log(f"init_from {path}: its labels {ckpt.config.get('labels')} are not this run's {labels}: the classifier's "
            "output layer starts new")
    with torch.no_grad():
        for name, tensor in own.items():
            src = ckpt.state_dict.get(name)
            if other_labels and name.startswith("classifier."):
                src = None
            if src is not None and src.shape == tensor.shape:
                tensor.copy_(src)
                copied.append(name)
            else:
                fresh.append(name)
    if not copied:
        raise QkvError(f"init_from {path}: no parameter of that checkpoint fits this model (nothing to start from)")
    log(f"init_from {path}: copied {len(copied)} tensors; new: {', '.join(fresh) if fresh else 'none'}")
    return copied, fresh


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel and/or ``torch.compile`` wrapper."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            module = module._orig_mod
        else:
            return module

"""The training loop: it learns, and a stopped-and-resumed run equals an uninterrupted one."""

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

import qkv
from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.errors import ConfigError, QkvError
from qkv.checkpoint import read_checkpoint
from qkv.training.trainer import ParallelData, train

QUIET = lambda msg: None  # noqa: E731


def numbers(lo: int, hi: int, step: int = 1) -> ParallelData:
    pairs = [(toy.english(n), toy.german(n)) for n in range(lo, hi, step)]
    return ParallelData([s for s, _ in pairs], [t for _, t in pairs], name=f"numbers {lo}..{hi}")


MODEL = ModelConfig(d_model=64, n_heads=4, d_ff=128, n_encoder_layers=1, n_decoder_layers=1,
                    dropout=0.1, attention_dropout=0.1, max_positions=64)
TRAIN = TrainConfig(tokenizer="char", vocab_size=100, max_len=64, max_tokens=1024, lr_scale=2.0,
                    warmup_steps=50, max_steps=12, eval_every=6, eval_bleu_samples=4, seed=3)


def test_resume_continues_exactly(tmp_path):
    data, valid = numbers(1, 400, 3), numbers(2, 400, 50)
    cfg = dataclasses.replace(TRAIN, update_freq=2)
    full = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "full", log=QUIET)
    part = train(MODEL, dataclasses.replace(cfg, max_steps=5), DecodeConfig(), data, valid, tmp_path / "part", log=QUIET)
    assert part.step == 5
    resumed = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "part", resume=True, log=QUIET)
    assert full.step == resumed.step == 12
    a = read_checkpoint(tmp_path / "full" / "last").state_dict
    b = read_checkpoint(tmp_path / "part" / "last").state_dict
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-identical: same batches, same dropout masks
    sa = read_checkpoint(tmp_path / "full" / "last", need_trainer_state=True).trainer_state
    sb = read_checkpoint(tmp_path / "part" / "last", need_trainer_state=True).trainer_state
    assert (sa["epoch"], sa["batch_in_epoch"]) == (sb["epoch"], sb["batch_in_epoch"])
    # metrics are appended, one validation record per evaluation, with the train records between
    records = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "valid_loss" in r] == [5, 6, 12]
    assert any("train_loss" in r and "lr" in r and "tokens_per_s" in r for r in records)


def test_a_different_seed_gives_different_weights(tmp_path):
    data = numbers(1, 200, 2)
    a = train(MODEL, dataclasses.replace(TRAIN, max_steps=3), DecodeConfig(), data, None, tmp_path / "a", log=QUIET)
    b = train(MODEL, dataclasses.replace(TRAIN, max_steps=3, seed=4), DecodeConfig(), data, None, tmp_path / "b", log=QUIET)
    wa = read_checkpoint(a.out_dir / "last").state_dict
    wb = read_checkpoint(b.out_dir / "last").state_dict
    assert not torch.equal(wa["encoder_layers.0.ffn.w_1.weight"], wb["encoder_layers.0.ffn.w_1.weight"])


def test_training_learns_the_number_task(tmp_path):
    """A small end-to-end run must actually learn: held-out numbers translated exactly."""
    torch.set_num_threads(2)
    data = numbers(1, 1000)
    held_out = [n for n in range(1, 1000, 7)]
    train_data = ParallelData([s for i, s in enumerate(data.src) if (i + 1) % 7 != 1],
                              [t for i, t in enumerate(data.tgt) if (i + 1) % 7 != 1], name="numbers")
    valid = ParallelData([toy.english(n) for n in held_out], [toy.german(n) for n in held_out], name="held-out")
    model_cfg = dataclasses.replace(MODEL, d_model=96, d_ff=256, n_encoder_layers=2, n_decoder_layers=2,
                                    dropout=0.1, attention_dropout=0.0)
    cfg = dataclasses.replace(TRAIN, tokenizer="bpe", vocab_size=120, max_tokens=1024, lr_scale=1.0,
                              warmup_steps=60, max_steps=300, eval_every=1000, eval_bleu_samples=0, seed=1)
    result = train(model_cfg, cfg, DecodeConfig(), train_data, valid, tmp_path / "run", log=QUIET)
    assert result.valid["valid_loss"] < 1.2  # started near ln(V) ~ 4.8
    model = qkv.load(tmp_path / "run" / "best")
    hyps = model.translate(valid.src, beam_size=1)
    exact = sum(h == r for h, r in zip(hyps, valid.tgt)) / len(hyps)
    assert exact >= 0.8, list(zip(valid.src, hyps))[:10]


def test_refuses_to_overwrite_or_resume_nothing(tmp_path):
    data = numbers(1, 100, 3)
    with pytest.raises(QkvError, match="cannot resume"):
        train(MODEL, TRAIN, DecodeConfig(), data, None, tmp_path / "none", resume=True, log=QUIET)
    train(MODEL, dataclasses.replace(TRAIN, max_steps=1), DecodeConfig(), data, None, tmp_path / "r", log=QUIET)
    with pytest.raises(QkvError, match="already holds a run"):
        train(MODEL, TRAIN, DecodeConfig(), data, None, tmp_path / "r", log=QUIET)
    with pytest.raises(QkvError, match="no training pairs"):
        train(MODEL, TRAIN, DecodeConfig(), ParallelData([], [], name="empty"), None, tmp_path / "e", log=QUIET)


def test_resume_refuses_an_update_freq_that_changes_the_update_size(tmp_path):
    """--update-freq may change on --resume only to keep update_freq x processes (here one process: not at all);
    the refusal names both sizes and the value that keeps it, and the run is left as it was."""
    data = numbers(1, 100, 3)
    cfg = dataclasses.replace(TRAIN, max_steps=2, eval_every=2, update_freq=3)
    train(MODEL, cfg, DecodeConfig(), data, None, tmp_path / "r", log=QUIET)
    before = read_checkpoint(tmp_path / "r" / "last", need_trainer_state=True).trainer_state["step"]
    with pytest.raises(QkvError) as e:
        train(MODEL, dataclasses.replace(cfg, update_freq=2, max_steps=4), DecodeConfig(), data, None, tmp_path / "r",
              resume=True, log=QUIET)
    assert str(e.value).startswith("--update-freq 2 with 1 process(es) makes an update of 2 batches where ")
    assert "took 3 (3 x 1 process(es))" in str(e.value) and "(give --update-freq 3)" in str(e.value)
    assert read_checkpoint(tmp_path / "r" / "last", need_trainer_state=True).trainer_state["step"] == before == 2


# --- device, mixed precision, torch.compile ---------------------------------------------------------

def test_bf16_autocast_trains_with_a_finite_loss(tmp_path):
    data = numbers(1, 200, 2)
    cfg = dataclasses.replace(TRAIN, max_steps=3, amp="bf16", device="cpu")
    result = train(MODEL, cfg, DecodeConfig(), data, numbers(2, 200, 40), tmp_path / "bf16", log=QUIET)
    assert result.step == 3 and math.isfinite(result.valid["valid_loss"])
    records = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
    weights = read_checkpoint(tmp_path / "bf16" / "last").state_dict
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())  # fp32 master weights


def test_hardware_settings_are_checked_by_name():
    with pytest.raises(ConfigError, match="'amp'"):
        dataclasses.replace(TRAIN, amp="fp8").validate()
    with pytest.raises(ConfigError, match="'amp'.*CUDA"):
        dataclasses.replace(TRAIN, amp="fp16", device="cpu").validate()
    with pytest.raises(ConfigError, match="'device'"):
        dataclasses.replace(TRAIN, device="gpu").validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    for cfg, field_name in ((dataclasses.replace(TRAIN, device="cuda"), "'device'"),
                            (dataclasses.replace(TRAIN, amp="fp16"), "'amp'")):  # device auto = cpu here
        with pytest.raises(ConfigError, match=field_name):
            train(MODEL, cfg, DecodeConfig(), numbers(1, 50), None, tmp_path / "x", log=QUIET)
    assert not (tmp_path / "x").exists()


def _compiled_run(tmp_path, name: str) -> None:
    """Two compiled updates: the plain model is saved, and it matches two uncompiled updates."""
    model = dataclasses.replace(MODEL, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, attention_dropout=0.0)
    cfg = dataclasses.replace(TRAIN, max_steps=2, eval_every=2, device="cpu", adam_eps=1e-6)
    data = numbers(1, 200, 2)
    compiled_cfg = dataclasses.replace(cfg, compile=True)
    result = train(model, compiled_cfg, DecodeConfig(), data, None, tmp_path / name, log=QUIET)
    assert result.step == 2
    train(model, cfg, DecodeConfig(), data, None, tmp_path / "plain", log=QUIET)
    compiled = read_checkpoint(tmp_path / name / "last").state_dict
    plain = read_checkpoint(tmp_path / "plain" / "last").state_dict
    assert compiled.keys() == plain.keys()  # no "_orig_mod." prefixes
    for k in plain:
        torch.testing.assert_close(compiled[k], plain[k], atol=1e-5, rtol=1e-4, msg=k)


def test_compile_wiring_with_dynamo_only(tmp_path, monkeypatch):
    """torch.compile traces the training forward (dynamo's eager backend: no C++ build, seconds)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    _compiled_run(tmp_path, "eager")


@pytest.mark.long  # inductor's C++ build of the training graphs takes minutes on 2 CPU cores
def test_compile_with_inductor_trains_two_steps(tmp_path):
    if not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")):
        pytest.skip("torch.compile's inductor backend needs a C++ compiler on the CPU, and none was found")
    _compiled_run(tmp_path, "inductor")



RNN_FUSED = {  # recurrent encoder-decoders: parallel and input-feeding (sequential) decoders, tied and untied output
    "lstm-context": dict(arch="lstm", attention="none"),
    "lstm-general-feed": dict(arch="lstm", attention="general", input_feeding=True),
    "gru-additive-untied": dict(arch="gru", attention="additive", input_feeding=False, tie_output=False),
}


@pytest.mark.parametrize("task", ["translate", "lm", *RNN_FUSED])
def test_fused_loss_gives_the_gradients_of_the_unfused_loss(task):
    """fused_loss (output projection + loss chunk by chunk) is an implementation choice only: the
    task's loss and every parameter's gradient equal logits-then-loss (compared as gradients: Adam
    would turn the rounding noise of gradients that are exactly 0 in theory, such as the key
    biases', into full-size steps)."""
    from qkv.models import build_model
    from qkv.tasks.base import token_loss

    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL, src_vocab_size=40, tgt_vocab_size=40, dropout=0.2, attention_dropout=0.1)
    if task == "lm":
        cfg = dataclasses.replace(cfg, task="lm", n_decoder_layers=2)
    if task in RNN_FUSED:
        cfg = dataclasses.replace(cfg, bidirectional=True, **RNN_FUSED[task])
    model = build_model(cfg).double().train()
    assert hasattr(model, "output_weight")  # else token_loss would compare the unfused loss with itself
    src, tgt = torch.randint(4, 40, (3, 6)), torch.randint(4, 40, (3, 5))
    tgt[1, 3:] = 0
    inputs = (tgt,) if task == "lm" else (src, tgt)
    grads = {}
    for fused in (True, False):
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks: both paths must drop the same units (h̃ included)
        loss, nll = token_loss(model, inputs, tgt, dataclasses.replace(TRAIN, fused_loss=fused, label_smoothing=0.1))
        loss.backward()
        grads[fused] = (loss.item(), nll.item(), {k: p.grad.clone() for k, p in model.named_parameters()})
    assert grads[True][0] == pytest.approx(grads[False][0], rel=1e-12)
    assert grads[True][1] == pytest.approx(grads[False][1], rel=1e-12)
    for k, g in grads[False][2].items():
        torch.testing.assert_close(grads[True][2][k], g, rtol=1e-10, atol=1e-12, msg=k)


def test_patience_stops_after_that_many_validations_without_a_new_best(tmp_path, monkeypatch):
    """Early stopping: the validation losses are scripted; best/ is the last improvement."""
    from qkv.training import trainer as trainer_mod

    losses = iter([3.0, 2.0, 2.5, 1.9, 2.2, 2.1, 2.0, 9.9, 9.9, 9.9])
    real_validate = trainer_mod.Trainer.validate

    def scripted(self):
        return {**real_validate(self), "valid_loss": next(losses)}

    monkeypatch.setattr(trainer_mod.Trainer, "validate", scripted)
    logs: list[str] = []
    cfg = dataclasses.replace(TRAIN, max_steps=100, eval_every=2, eval_bleu_samples=0, patience=3)
    data, valid = numbers(1, 200, 2), numbers(3, 200, 40)
    result = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "run", log=logs.append)
    # new bests at validations 1, 2, 4 (1.9); then 2.2, 2.1, 2.0 are three without one: stop at the 7th
    assert result.step == 14
    assert any("converged: 3 validations in a row without a new best valid_loss (patience=3)" in m for m in logs)
    state = read_checkpoint(tmp_path / "run" / "best", need_trainer_state=True).trainer_state
    assert state["step"] == 8 and state["best_score"] == 1.9
    last = read_checkpoint(tmp_path / "run" / "last", need_trainer_state=True).trainer_state
    assert last["bad_evals"] == 3
    # resuming a converged run trains nothing more; a larger patience continues it
    again = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "run", resume=True, log=QUIET)
    assert again.step == 14
    more = train(MODEL, dataclasses.replace(cfg, patience=4), DecodeConfig(), data, valid, tmp_path / "run",
                 resume=True, log=QUIET)
    assert more.step == 16  # one more validation (9.9) is the fourth without a new best


def test_patience_must_not_be_negative_nor_without_validation_data(tmp_path):
    with pytest.raises(ConfigError, match="patience"):
        dataclasses.replace(TRAIN, patience=-1).validate()
    with pytest.raises(QkvError, match="patience=2 stops training by the validation results"):
        train(MODEL, dataclasses.replace(TRAIN, patience=2), DecodeConfig(), numbers(1, 50), None, tmp_path / "r",
              log=QUIET)
    assert not (tmp_path / "r").exists()


def test_lr_shrink_reduces_the_rate_on_plateau_then_patience_stops(tmp_path, monkeypatch):
    """Reduce on plateau (fairseq's --lr-shrink): patience running out shrinks the rate, up to
    max_lr_shrinks times; the next time it stops training. Validation losses are scripted."""
    from qkv.training import trainer as trainer_mod

    losses = iter([3.0, 2.0, 2.5, 2.4, 1.9, 2.0, 2.1, 2.2, 2.3, 2.5, 2.6])
    real_validate = trainer_mod.Trainer.validate
    monkeypatch.setattr(trainer_mod.Trainer, "validate", lambda self: {**real_validate(self), "valid_loss": next(losses)})
    logs: list[str] = []
    cfg = dataclasses.replace(TRAIN, schedule="constant", lr=1e-3, lr_scale=1.0, max_steps=100, eval_every=2,
                              eval_bleu_samples=0, patience=2, lr_shrink=0.5, max_lr_shrinks=2)
    data, valid = numbers(1, 200, 2), numbers(3, 200, 40)
    result = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "run", log=logs.append)
    # 2.5, 2.4: shrink 1 (step 8); 1.9 best; 2.0, 2.1: shrink 2 (step 14); 2.2, 2.3: stop (step 18)
    assert result.step == 18
    assert [m.split(":")[0] for m in logs if "learning rate x0.5" in m] == ["step 8", "step 14"]
    assert any("patience=2, after 2 learning-rate shrinks" in m for m in logs)
    state = read_checkpoint(tmp_path / "run" / "last", need_trainer_state=True).trainer_state
    assert state["lr_shrinks"] == 2 and state["bad_evals"] == 2
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 * 0.25)
    # resumed with one more shrink allowed: it shrinks at once and trains on until patience runs out again
    more = train(MODEL, dataclasses.replace(cfg, max_lr_shrinks=3), DecodeConfig(), data, valid, tmp_path / "run",
                 resume=True, log=QUIET)
    assert more.step == 22
    state = read_checkpoint(tmp_path / "run" / "last", need_trainer_state=True).trainer_state
    assert state["lr_shrinks"] == 3
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 * 0.125)


@pytest.mark.parametrize("fields, match", [
    (dict(lr_shrink=0.0), "lr_shrink"), (dict(lr_shrink=1.5), "lr_shrink"),
    (dict(patience=2, max_lr_shrinks=2), "set lr_shrink below 1"),
    (dict(lr_shrink=0.5, max_lr_shrinks=2), "set patience too"),
    (dict(patience=2, lr_shrink=0.5, max_lr_shrinks=-1), "max_lr_shrinks"),
])
def test_lr_shrink_settings_are_checked(fields, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(TRAIN, **fields).validate()


# --- optimizer = "nag": fairseq 0.9's default optimizer ----------------------------------------------

def _fairseq_nag_steps(theta, grads, lrs, mu):
    """fairseq 0.9's NAG update (fairseq/optim/nag.py), written out: the buffer holds the rate,
    and is rescaled by lr / lr_prev when the rate changes."""
    theta, buf, lr_old = theta.clone(), torch.zeros_like(theta), lrs[0]
    for g, lr in zip(grads, lrs):
        corr = lr / lr_old
        theta = theta + mu * mu * corr * buf - (1 + mu) * lr * g
        buf = mu * corr * buf - lr * g
        lr_old = lr
    return theta


def test_nag_is_fairseqs_update_with_a_changing_rate():
    from qkv.training.trainer import build_optimizer
    torch.manual_seed(0)
    theta0 = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(6)]
    lrs = [1e-3, 2e-3, 3e-3, 2.5e-3, 2e-3, 1.8e-3]  # warmup, then decay
    p = torch.nn.Parameter(theta0.clone())
    opt = build_optimizer([p], dataclasses.replace(TRAIN, optimizer="nag", momentum=0.9))
    assert isinstance(opt, torch.optim.SGD)
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad = g.clone()
        opt.step()
    expected = _fairseq_nag_steps(theta0, grads, lrs, 0.9)
    assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-12)
    # and not plain momentum SGD: the Nesterov look-ahead changes the result
    q = torch.nn.Parameter(theta0.clone())
    heavy = torch.optim.SGD([q], lr=0.0, momentum=0.9)
    for g, lr in zip(grads, lrs):
        heavy.param_groups[0]["lr"] = lr
        q.grad = g.clone()
        heavy.step()
    assert not torch.allclose(q.detach(), expected, atol=1e-6)


def test_nag_trains_and_resumes_exactly(tmp_path):
    data, valid = numbers(1, 400, 3), numbers(2, 400, 50)
    cfg = dataclasses.replace(TRAIN, optimizer="nag", schedule="inverse_sqrt", lr_scale=1.0, lr=0.05,
                              warmup_steps=4, update_freq=2)
    full = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "full", log=QUIET)
    train(MODEL, dataclasses.replace(cfg, max_steps=5), DecodeConfig(), data, valid, tmp_path / "part", log=QUIET)
    resumed = train(MODEL, cfg, DecodeConfig(), data, valid, tmp_path / "part", resume=True, log=QUIET)
    assert full.step == resumed.step == 12
    a = read_checkpoint(tmp_path / "full" / "last").state_dict
    b = read_checkpoint(tmp_path / "part" / "last").state_dict
    for k in a:
        assert torch.equal(a[k], b[k]), k  # the momentum buffers were saved and restored
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    first = next(r["train_loss"] for r in records if "train_loss" in r)  # the loss at the start, ~ln V
    valid_losses = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert first > valid_losses[0] > valid_losses[1]  # it learns


@pytest.mark.parametrize("fields, match", [
    ({"optimizer": "sgd"}, "'optimizer'"),
    ({"optimizer": "nag", "momentum": 0.0}, "'momentum'"),
    ({"momentum": 1.0}, "'momentum'"),
])
def test_optimizer_settings_are_checked(fields, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(TRAIN, **fields).validate()

from pathlib import Path

import pytest

from qkv.training.schedule import noam, peak_lr


def test_literal_values():
    # d_model = 512, warmup = 4000: d_model^-0.5 = 0.04419417, warmup^-1.5 = 3.9528471e-06
    assert noam(1, 512, 4000) == pytest.approx(0.04419417 * 3.9528471e-06, rel=1e-6)  # 1.7469e-07
    assert noam(1, 512, 4000) == pytest.approx(1.7469e-07, rel=1e-4)
    assert noam(4000, 512, 4000) == pytest.approx(6.9877e-04, rel=1e-4)  # 0.04419417 / sqrt(4000)
    assert noam(16000, 512, 4000) == pytest.approx(3.4939e-04, rel=1e-4)  # half the peak: sqrt(16000/4000) = 2
    assert noam(100, 16, 4, scale=2.0) == pytest.approx(2.0 * 0.25 * 0.1)  # 16^-0.5 = 0.25, 100^-0.5 = 0.1


def test_step_zero_is_step_one():
    assert noam(0, 512, 4000) == noam(1, 512, 4000)
    with pytest.raises(ValueError):
        noam(-1, 512, 4000)


def test_peak_at_warmup():
    assert peak_lr(512, 4000) == pytest.approx(noam(4000, 512, 4000))
    assert peak_lr(512, 4000, scale=2.0) == pytest.approx(2 * 6.9877e-04, rel=1e-4)
    values = [noam(s, 512, 4000) for s in range(1, 20001, 7)]
    assert max(values) <= peak_lr(512, 4000) * (1 + 1e-12)
    assert noam(3999, 512, 4000) < noam(4000, 512, 4000) > noam(4001, 512, 4000)


def test_linear_before_inverse_sqrt_after():
    # Linear warmup: lr(2s) = 2 lr(s).
    assert noam(2000, 512, 4000) == pytest.approx(2 * noam(1000, 512, 4000))
    assert noam(3000, 512, 4000) == pytest.approx(3 * noam(1000, 512, 4000))
    # Inverse square root decay: lr(4s) = lr(s) / 2.
    assert noam(40000, 512, 4000) == pytest.approx(noam(10000, 512, 4000) / 2)
    assert noam(90000, 512, 4000) == pytest.approx(noam(10000, 512, 4000) / 3)


def test_constant_and_inverse_sqrt_by_hand():
    from qkv.training.schedule import constant, inverse_sqrt, learning_rate

    assert constant(0, 1e-3) == constant(12345, 1e-3) == 1e-3
    assert inverse_sqrt(1, 1e-3, 100) == pytest.approx(1e-5)  # 1/100 of the peak
    assert inverse_sqrt(50, 1e-3, 100) == pytest.approx(5e-4)  # linear warmup
    assert inverse_sqrt(100, 1e-3, 100) == pytest.approx(1e-3)  # the peak
    assert inverse_sqrt(400, 1e-3, 100) == pytest.approx(5e-4)  # sqrt(100/400) = 1/2
    assert inverse_sqrt(0, 1e-3, 100) == inverse_sqrt(1, 1e-3, 100)
    assert learning_rate("constant", 7, d_model=256, warmup=10) == 1e-3  # lr = 0: the default
    assert learning_rate("constant", 7, d_model=256, warmup=10, lr=5e-4) == 5e-4
    assert learning_rate("inverse_sqrt", 40, d_model=256, warmup=10, lr=2e-3) == pytest.approx(1e-3)
    assert learning_rate("noam", 4000, d_model=512, warmup=4000) == pytest.approx(6.9877e-04, rel=1e-4)
    with pytest.raises(ValueError, match="schedule"):
        learning_rate("cosine", 1, d_model=8, warmup=1)


def test_schedule_config_fields_are_checked_by_name():
    from qkv.config import TrainConfig
    from qkv.errors import ConfigError

    TrainConfig(schedule="constant", lr=1e-3).validate()
    with pytest.raises(ConfigError, match="'schedule'"):
        TrainConfig(schedule="linear").validate()
    with pytest.raises(ConfigError, match="'lr'"):
        TrainConfig(lr=-1.0, schedule="constant").validate()
    with pytest.raises(ConfigError, match="'lr'"):
        TrainConfig(lr=1e-3).validate()  # noam ignores lr: refuse rather than silently ignore
    with pytest.raises(ConfigError, match="'lr_scale'"):
        TrainConfig(schedule="constant", lr_scale=2.0).validate()


def test_cooldown_falls_linearly_to_one_over_its_length_at_the_last_update():
    from qkv.training.schedule import cooldown

    assert cooldown(1, 900, 0) == cooldown(900, 900, 0) == 1.0  # none
    assert cooldown(600, 900, 300) == 1.0 and cooldown(601, 900, 300) == 1.0  # before it: 300/300
    assert cooldown(750, 900, 300) == pytest.approx(151 / 300)
    assert cooldown(900, 900, 300) == pytest.approx(1 / 300)  # the last update still moves
    assert cooldown(950, 900, 300) == 0.0  # past max_steps (a resumed run given fewer): no update


def test_the_trainer_rate_is_the_schedule_times_the_cooldown():
    from types import SimpleNamespace

    from qkv.config import ConfigError, ModelConfig, TrainConfig
    from qkv.training.trainer import Trainer

    cfg = TrainConfig(max_steps=900, cooldown_steps=300, warmup_steps=300, lr_scale=0.5)
    fake = SimpleNamespace(train_cfg=cfg, model_cfg=ModelConfig(d_model=128), lr_shrinks=0)
    peak = 0.5 * 128 ** -0.5 * 300 ** -0.5
    assert Trainer.lr(fake, 300) == pytest.approx(peak)
    assert Trainer.lr(fake, 750) == pytest.approx(peak * (300 / 750) ** 0.5 * 151 / 300)
    with pytest.raises(ConfigError, match="cooldown_steps"):
        TrainConfig(max_steps=100, cooldown_steps=-1).validate()
    TrainConfig(max_steps=3, cooldown_steps=300).validate()  # a quick --max-steps on a recipe with a cooldown


def test_a_run_shorter_than_its_cooldown_cools_down_over_all_its_updates():
    from qkv.training.schedule import cooldown

    assert [cooldown(s, 3, 300) for s in (1, 2, 3)] == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert cooldown(900, 900, 300) == pytest.approx(1 / 300)  # a run as long as its recipe: unchanged


def _resolved(argv, embedded):
    from qkv import cli, cli_options

    parser = cli_options.build_parser({name: None for name in cli.COMMANDS})
    return cli.resolve_configs(parser.parse_args(["train", "--out", "runs/x", *argv]), embedded=embedded)


def _rate_at(configs, step):
    from types import SimpleNamespace

    from qkv.training.trainer import Trainer

    model, train, _ = configs
    return Trainer.lr(SimpleNamespace(train_cfg=train, model_cfg=model, lr_shrinks=0), step)


@pytest.mark.parametrize("argv", [["--arch", "lstm", "--attention", "additive"], ["--arch", "gru", "--attention", "none"],
                                  ["--arch", "rnn"]])
def test_a_recurrent_model_on_the_embedded_task_gets_its_constant_rate(argv):
    """docs/recurrent.md's first commands: the recipe's noam lr_scale does not follow the RNN to its constant schedule."""
    from qkv.data import toy

    configs = _resolved(argv, embedded=True)
    assert configs[1].schedule == "constant" and configs[1].lr_scale == 1.0
    assert _rate_at(configs, 1) == pytest.approx(2e-3 * 1.0)  # the first update, before the cooldown starts
    assert configs[1] == toy.RNN_TRAIN  # the recipe's other settings unchanged
    assert toy.RNN_TRAIN.max_steps == toy.TRAIN.max_steps and toy.RNN_TRAIN.max_tokens == toy.TRAIN.max_tokens


def test_a_recurrent_language_model_trains_at_a_constant_1e_3_as_concepts_says():
    """docs/language-models.md's LSTM on given data: not the preset's 4,000-update warmup (2.8e-7 at update 1)."""
    concepts = (Path(__file__).parent.parent / "docs" / "concepts.md").read_text()
    assert "RNNs: Adam at a constant 1e-3" in concepts
    lm = ["--task", "lm", "--arch", "lstm", "--train", "t.txt", "--tokenizer", "char", "--d-model", "200"]
    configs = _resolved(lm, embedded=False)
    assert configs[1].schedule == "constant"
    assert [_rate_at(configs, s) for s in (1, 4000, 50_000)] == pytest.approx([1e-3] * 3)
    transformer = _resolved(["--task", "lm", "--train", "t.txt"], embedded=False)
    assert transformer[1].schedule == "noam" and _rate_at(transformer, 1) < 1e-6  # the Transformer keeps its warmup


@pytest.mark.parametrize("argv, schedule, rate", [
    (["--arch", "lstm", "--lr", "5e-4"], "constant", 5e-4),  # a rate alone: the recurrent schedule at that rate
    (["--arch", "lstm", "--schedule", "inverse_sqrt", "--lr", "2e-3", "--warmup-steps", "10"], "inverse_sqrt", 2e-4),
    # lr_scale chooses noam: the preset's (d_model 256, warmup 4000) and the recipe's (d_model 128, warmup 300)
    (["--arch", "lstm", "--lr-scale", "2"], "noam", (2 * 256 ** -0.5 * 4000 ** -1.5, 2 * 128 ** -0.5 * 300 ** -1.5)),
    (["--schedule", "constant"], "constant", 1e-3),  # the Transformer recipe's lr_scale does not follow either
])
def test_a_chosen_schedule_keeps_its_own_rate_and_drops_the_others(argv, schedule, rate):
    for embedded in (False, True):
        configs = _resolved(argv, embedded)
        want = rate[embedded] if isinstance(rate, tuple) else rate
        assert configs[1].schedule == schedule
        assert _rate_at(configs, 1) == pytest.approx(want, rel=1e-6), (argv, embedded)


def test_a_config_file_choosing_noam_drops_a_constant_rate(tmp_path):
    """The rule is the layering's: a later layer that changes the schedule takes the old schedule's rate field back
    to its default unless it sets it; one that sets it is checked as before."""
    from qkv.config import RECURRENT_SCHEDULE, TrainConfig, layered, override, DecodeConfig, ModelConfig
    from qkv.errors import ConfigError

    base = (ModelConfig(), TrainConfig(schedule="constant", lr=3e-3), DecodeConfig())
    _, train, _ = layered(base, {"train": {"schedule": "noam"}}, "f.toml", {})
    assert (train.schedule, train.lr, train.lr_scale) == ("noam", 0.0, 1.0)
    with pytest.raises(ConfigError, match="'lr'"):
        layered(base, {"train": {"schedule": "noam", "lr": 3e-3}}, "f.toml", {})
    assert override(TrainConfig(lr_scale=0.5), {"schedule": "inverse_sqrt"}).lr_scale == 1.0
    assert override(TrainConfig(schedule="constant", lr=2e-3), {"schedule": "inverse_sqrt"}).lr == 2e-3  # lr rates both
    assert RECURRENT_SCHEDULE["schedule"] == "constant"

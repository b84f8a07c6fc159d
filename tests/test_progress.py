"""The training log's clock: time trained and an estimate of the time left."""

import dataclasses
import re

import pytest

from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.training.progress import clock, clock_fields, time_left
from qkv.training.trainer import ParallelData, train


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (41, "0:41"), (82, "1:22"), (59.6, "1:00"),
                                           (3599, "59:59"), (3600, "1:00:00"), (3725, "1:02:05"),
                                           (100 * 3600 + 61, "100:01:01"), (-3, "0:00")])
def test_clock(seconds, text):
    assert clock(seconds) == text


@pytest.mark.parametrize("step, max_steps, elapsed, max_time, expected", [
    (200, 600, 41.0, 0.0, (82.0, "max_steps")),     # 400 updates to go at 41/200 s each
    (200, 600, 41.0, 200.0, (82.0, "max_steps")),   # the step limit comes first (41 + 82 < 200)
    (200, 600, 41.0, 60.0, (19.0, "max_time")),     # the time limit comes first: 60 - 41
    (600, 600, 100.0, 0.0, (0.0, "max_steps")),     # done
    (0, 600, 3.0, 10.0, (7.0, "max_time")),         # no update yet: only the time limit is known
    (10, 600, 70.0, 60.0, (0.0, "max_time")),       # past the time limit (the update under way finishes)
    (0, 600, 0.0, 0.0, None),                       # nothing to estimate from
])
def test_time_left(step, max_steps, elapsed, max_time, expected):
    assert time_left(step, max_steps, elapsed, max_time) == expected


def test_clock_fields():
    assert clock_fields(200, 600, 41.0) == "elapsed 0:41  left ~1:22"
    assert clock_fields(200, 600, 41.0, max_time=60.0) == "elapsed 0:41  left ~0:19 (max_time)"
    assert clock_fields(0, 600, 0.0) == "elapsed 0:00"


def test_a_short_run_logs_elapsed_and_left(tmp_path, one_torch_thread):
    pairs = [(toy.english(n), toy.german(n)) for n in range(1, 200)]
    data = ParallelData([s for s, _ in pairs], [t for _, t in pairs], name="numbers")
    model = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, max_positions=64)
    cfg = TrainConfig(tokenizer="char", vocab_size=100, max_len=64, max_tokens=512, warmup_steps=10, max_steps=50,
                      eval_every=1000, eval_bleu_samples=0, seed=1)
    lines: list[str] = []
    train(model, cfg, DecodeConfig(), data, None, tmp_path / "run", log=lines.append)
    progress = [line for line in lines if line.startswith("step ")]
    # the first update and every 50th: step N/50 ... elapsed M:SS  left ~M:SS
    assert [int(re.match(r"step (\d+)/50 ", line).group(1)) for line in progress] == [1, 50], lines
    for line in progress:
        assert re.search(r"  elapsed \d+:\d\d  left ~\d+:\d\d$", line), line
    assert progress[-1].endswith("left ~0:00")
    # a time limit that ends the run first is named
    lines.clear()
    # (10**7 updates take more than an hour at any speed; one epoch ends this run)
    train(model, dataclasses.replace(cfg, max_steps=10**7, max_time=3600.0, max_epochs=1), DecodeConfig(), data,
          None, tmp_path / "timed", log=lines.append)
    first = next(line for line in lines if line.startswith("step 1/10000000 "))
    assert re.search(r"elapsed 0:\d\d  left ~(59:\d\d|1:00:00) \(max_time\)$", first), first

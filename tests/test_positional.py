import math

import pytest
import torch

from qkv.nn.positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding, sinusoidal_table


def test_table_matches_the_papers_formula():
    d = 4
    pe = sinusoidal_table(3, d)
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
    assert pe[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert pe[1, 0].item() == pytest.approx(math.sin(1))
    assert pe[1, 1].item() == pytest.approx(math.cos(1))
    assert pe[2, 2].item() == pytest.approx(math.sin(2 / 100))  # 10000^(2/4) = 100
    assert pe[2, 3].item() == pytest.approx(math.cos(2 / 100))


def test_every_entry_against_the_formula_and_wavelengths():
    d, n = 32, 60
    pe = sinusoidal_table(n, d)
    for pos in (0, 7, 59):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    # lower dimensions change fastest: mean absolute step between positions falls with i
    steps = (pe[1:] - pe[:-1]).abs().mean(0)
    assert steps[0] > steps[10] > steps[30]


def test_offset_and_growth():
    enc = SinusoidalPositionalEncoding(8, max_positions=4)
    assert torch.allclose(enc(2, offset=3)[0], sinusoidal_table(5, 8)[3:5])
    assert torch.allclose(enc(10)[0], sinusoidal_table(10, 8))  # grows beyond the initial table


def test_learned_positions_have_a_limit_and_gradients():
    enc = LearnedPositionalEncoding(8, max_positions=5)
    out = enc(3, offset=1)
    out.sum().backward()
    assert enc.weight.grad[1:4].abs().sum() > 0 and enc.weight.grad[0].abs().sum() == 0
    with pytest.raises(ValueError, match="max_positions=5"):
        enc(6)

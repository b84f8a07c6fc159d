"""qkv's CPU dropout against the definition: keep each element with probability 1 − p, scale the
kept ones by 1 / (1 − p), draw anew each call; the gradient is the same mask and scale."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.nn.dropout import LANE_VALUES, dropout, keep_mask


def quantised(p: float) -> float:
    return round(p * LANE_VALUES) / LANE_VALUES


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_kept_fraction_and_scale_match_the_definition(p):
    torch.manual_seed(0)
    x = torch.randn(1000, 1000)
    y = dropout(x, p)
    kept = y != 0
    q = quantised(p)
    n = x.numel()
    sd = math.sqrt(q * (1 - q) / n)
    assert abs(kept.float().mean().item() - (1 - q)) < 5 * sd
    # kept elements are exactly x / (1 - q); dropped ones exactly 0
    torch.testing.assert_close(y[kept], x[kept] / (1 - q), rtol=1e-6, atol=0)
    assert abs(q - p) <= 0.5 / LANE_VALUES


def test_expectation_is_the_input():
    torch.manual_seed(1)
    y = torch.stack([dropout(torch.ones(4096), 0.3) for _ in range(200)])
    assert abs(y.mean().item() - 1.0) < 5 * math.sqrt(0.3 / 0.7 / y.numel())


def test_neighbouring_lanes_are_independent():
    # four elements share one 64-bit word: P(both kept) must be (1 - p)², not (1 - p)
    torch.manual_seed(2)
    keep, _ = keep_mask((4_000_000,), 0.3)
    both = (keep[0::4] & keep[1::4]).float().mean().item()
    assert abs(both - 0.7 ** 2) < 0.003
    both = (keep[0::4] & keep[3::4]).float().mean().item()
    assert abs(both - 0.7 ** 2) < 0.003


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(3)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.3)
    g = torch.randn_like(y)
    y.backward(g)
    mask_scale = torch.where(y != 0, 1 / (1 - quantised(0.3)), 0.0)
    torch.testing.assert_close(x.grad, g * mask_scale)


def test_fresh_masks_each_call_and_reproducible_under_a_seed():
    x = torch.ones(10_000)
    torch.manual_seed(4)
    a, b = dropout(x, 0.3), dropout(x, 0.3)
    torch.manual_seed(4)
    assert torch.equal(dropout(x, 0.3), a)
    assert not torch.equal(a, b)


def test_outside_training_and_at_the_edges_it_is_torchs():
    x = torch.randn(5, 7)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError):
        dropout(x, 1.5)
    with pytest.raises(ValueError):
        dropout(x, -0.1)
    # a p below half a lane step would quantise to 0: torch's own dropout then
    torch.manual_seed(5)
    y = dropout(torch.ones(10), 1e-6)
    torch.manual_seed(5)
    assert torch.equal(y, F.dropout(torch.ones(10), 1e-6))


def test_odd_sizes_and_shapes():
    torch.manual_seed(6)
    for shape in [(1,), (3,), (5, 3), (2, 3, 7)]:
        x = torch.randn(*shape)
        y = dropout(x, 0.5)
        assert y.shape == x.shape
        assert torch.all((y == 0) | torch.isclose(y, x * 2))

"""Alignment scores against hand-computed values; attention weights over non-padded positions."""

import math

import pytest
import torch

from qkv.masks import padding_mask
from qkv.nn.scores import SCORES, attend, attention_weights, build_score

# one query, two keys, d = 2, worked by hand below
Q = torch.tensor([[[1.0, 2.0]]])  # (B=1, T=1, d=2)
K = torch.tensor([[[3.0, 0.0], [1.0, 1.0]]])  # (B=1, S=2, d=2)


def test_dot_and_scaled_dot_by_hand():
    assert build_score("dot", 2, 2)(Q, K).tolist() == [[[3.0, 3.0]]]  # 1*3 + 2*0, 1*1 + 2*1
    q = torch.tensor([[[1.0, 2.0]]])
    k = torch.tensor([[[2.0, 1.0], [0.0, -1.0]]])
    s = build_score("scaled_dot", 2, 2)(q, k)
    assert torch.allclose(s, torch.tensor([[[4.0, -2.0]]]) / math.sqrt(2))


def test_general_by_hand():
    score = build_score("general", 2, 2)
    with torch.no_grad():
        score.W_a.weight.copy_(torch.tensor([[1.0, 2.0], [0.0, -1.0]]))  # W_a
    # W_a k1 = (3, 0), W_a k2 = (3, -1); q·: 3, 1
    assert score(Q, score.keys(K)).tolist() == [[[3.0, 1.0]]]


def test_general_with_different_sizes():
    score = build_score("general", 3, 2)
    q, k = torch.randn(2, 4, 3), torch.randn(2, 5, 2)
    expected = torch.einsum("btq,qk,bsk->bts", q, score.W_a.weight, k)
    assert torch.allclose(score(q, score.keys(k)), expected, atol=1e-6)


def test_additive_by_hand():
    score = build_score("additive", 2, 2)
    with torch.no_grad():
        score.W_a.weight.copy_(torch.eye(2))
        score.U_a.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
        score.U_a.bias.copy_(torch.tensor([0.5, -0.5]))
        score.v_a.weight.copy_(torch.tensor([[1.0, -2.0]]))
    # W q = (1, 2); U k1 + b = (0.5, 2.5); U k2 + b = (1.5, 0.5)
    e1 = math.tanh(1.5) - 2 * math.tanh(4.5)
    e2 = math.tanh(2.5) - 2 * math.tanh(2.5)
    assert torch.allclose(score(Q, score.keys(K)), torch.tensor([[[e1, e2]]]), atol=1e-6)


def test_cosine_by_hand():
    score = build_score("cosine", 2, 2)
    with torch.no_grad():
        score.beta.weight.zero_()
        score.beta.bias.fill_(2.0)
    beta = math.log1p(math.exp(2.0))  # softplus(2)
    cos1 = 3.0 / (math.sqrt(5) * 3.0)
    cos2 = 3.0 / (math.sqrt(5) * math.sqrt(2))
    assert torch.allclose(score(Q, score.keys(K)), torch.tensor([[[beta * cos1, beta * cos2]]]), atol=1e-6)
    # invariant to the scale of keys and query
    assert torch.allclose(score(3 * Q, score.keys(7 * K)), score(Q, score.keys(K)), atol=1e-6)


def test_location_by_hand_ignores_the_keys():
    score = build_score("location", 2, 2, max_positions=4)
    with torch.no_grad():
        score.W_a.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [5.0, 5.0]]))
        score.W_a.bias.zero_()
    assert score(Q, score.keys(K)).tolist() == [[[1.0, 2.0]]]  # positions 0 and 1 of W_a q = (1, 2, 3, 15)
    assert score(Q, torch.randn(1, 3, 2)).tolist() == [[[1.0, 2.0, 3.0]]]
    with pytest.raises(ValueError, match="max_positions"):
        score(Q, torch.randn(1, 5, 2))


@pytest.mark.parametrize("name", SCORES)
def test_weights_sum_to_one_over_real_tokens(name):
    torch.manual_seed(0)
    score = build_score(name, 4, 4, max_positions=16)
    src = torch.tensor([[5, 6, 7, 3, 0, 0], [5, 3, 0, 0, 0, 0]])
    memory = torch.randn(2, 6, 4)
    mask = padding_mask(src)[:, 0]  # (B, 1, S)
    context, a = attend(score, torch.randn(2, 3, 4), score.keys(memory), memory, mask)
    assert a.shape == (2, 3, 6) and context.shape == (2, 3, 4)
    assert torch.allclose(a.sum(-1), torch.ones(2, 3), atol=1e-6)
    assert (a[0, :, 4:] == 0).all() and (a[1, :, 2:] == 0).all()
    assert torch.allclose(context, torch.einsum("bts,bsd->btd", a, memory), atol=1e-6)


def test_attention_weights_softmax_by_hand():
    a = attention_weights(torch.tensor([[[0.0, math.log(3.0), 9.0]]]), torch.tensor([[[True, True, False]]]))
    assert torch.allclose(a, torch.tensor([[[0.25, 0.75, 0.0]]]))


def test_bad_score_names_and_sizes():
    with pytest.raises(ValueError, match="unknown score"):
        build_score("bilinear", 2, 2)
    with pytest.raises(ValueError, match="one size"):
        build_score("dot", 2, 3)

import torch

from qkv.masks import causal_mask, combine, padding_mask


def test_padding_mask_hides_pad_keys():
    tokens = torch.tensor([[5, 6, 3, 0], [7, 3, 0, 0]])
    m = padding_mask(tokens)
    assert m.shape == (2, 1, 1, 4)
    assert m[0, 0, 0].tolist() == [True, True, True, False]
    assert m[1, 0, 0].tolist() == [True, True, False, False]


def test_causal_mask_is_lower_triangular():
    m = causal_mask(3)
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_causal_mask_for_the_last_queries_of_a_longer_sequence():
    # 2 new queries at positions 2 and 3 of a 4-long sequence
    assert causal_mask(2, 4)[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_combine_is_logical_and_with_broadcasting():
    pad = padding_mask(torch.tensor([[4, 3, 0]]))
    m = combine(pad, None, causal_mask(3))
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert combine(None, None) is None

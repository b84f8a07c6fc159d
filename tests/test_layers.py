"""The encoder layer, run causally with a key/value cache, is also the decoder-only layer (qkv.nn.layers)."""

import pytest
import torch

from qkv.masks import causal_mask
from qkv.nn.layers import EncoderLayer


def layer(norm_first: bool) -> EncoderLayer:
    torch.manual_seed(0)
    return EncoderLayer(16, 2, 32, dropout=0.0, attention_dropout=0.0, norm_first=norm_first).eval()


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_causal_flag_is_the_causal_mask(norm_first):
    enc, x = layer(norm_first), torch.randn(2, 7, 16)
    flagged, cache, w_flagged = enc(x, causal=True, need_weights=True)
    masked, _, w_masked = enc(x, mask=causal_mask(7), need_weights=True)
    torch.testing.assert_close(flagged, masked, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w_flagged, w_masked)
    assert cache is None and (w_flagged.triu(1) == 0).all()


@pytest.mark.parametrize("norm_first", [False, True])
def test_with_a_cache_step_by_step_it_equals_the_causal_layer(norm_first):
    enc, x = layer(norm_first), torch.randn(3, 6, 16)
    full, _, _ = enc(x, causal=True)
    cache = enc.self_attn.empty_cache(3, x)
    steps = []
    for t in range(6):
        out, cache, _ = enc(x[:, t : t + 1], cache=cache)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.k.shape == (3, 2, 6, 8)  # (B, h, T, d_k)


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_keys_values_of_a_prefix_continue_the_causal_layer(norm_first):
    enc, x = layer(norm_first), torch.randn(2, 7, 16)
    full, _, _ = enc(x, causal=True)
    rest, grown, _ = enc(x[:, 4:], causal=True, cache=enc.keys_values(x[:, :4]))
    torch.testing.assert_close(rest, full[:, 4:], atol=1e-5, rtol=1e-5)
    assert grown.k.size(2) == 7

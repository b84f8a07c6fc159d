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



def uniform(t: torch.Tensor, bound: float) -> None:
    """``t`` looks drawn from U(-bound, bound): inside it, with its spread (std of U(-a, a) = a/√3)."""
    assert t.abs().max() <= bound
    assert t.std().item() == pytest.approx(bound / 3**0.5, rel=0.1)


@pytest.mark.parametrize("init", ["xavier", "fairseq"])
def test_linear_layers_start_as_the_init_setting_says(init):
    """From the formulas. Both: Q, K, V weights Xavier-uniform per d×d matrix with gain 1/√2 (bound
    √(6/(4d))), W^O Xavier-uniform with bias 0. xavier: FFN weights Xavier-uniform, every bias 0.
    fairseq (its Transformer's start): FFN weights and biases U(±1/√fan_in), torch's Linear
    default, and the Q, K, V biases U(±1/√d)."""
    from qkv.config import ModelConfig
    from qkv.nn.stack import stack_modules

    torch.manual_seed(0)
    d, d_ff = 128, 512
    cfg = ModelConfig(d_model=d, n_heads=4, d_ff=d_ff, init=init).validate()
    _, layers, _ = stack_modules(cfg, 2, EncoderLayer)
    for enc in layers:
        for w in enc.self_attn.in_proj.weight.chunk(3):  # W^Q, W^K, W^V
            uniform(w, 2**-0.5 * (6 / (d + d)) ** 0.5)
        uniform(enc.self_attn.out_proj.weight, (6 / (d + d)) ** 0.5)
        assert (enc.self_attn.out_proj.bias == 0).all()
        if init == "fairseq":
            uniform(enc.ffn.w_1.weight, d**-0.5)
            uniform(enc.ffn.w_1.bias, d**-0.5)
            uniform(enc.ffn.w_2.weight, d_ff**-0.5)
            uniform(enc.ffn.w_2.bias, d_ff**-0.5)
            uniform(enc.self_attn.in_proj.bias, d**-0.5)
        else:
            uniform(enc.ffn.w_1.weight, (6 / (d + d_ff)) ** 0.5)
            uniform(enc.ffn.w_2.weight, (6 / (d + d_ff)) ** 0.5)
            for b in (enc.ffn.w_1.bias, enc.ffn.w_2.bias, enc.self_attn.in_proj.bias):
                assert (b == 0).all()


def test_an_unknown_init_is_refused_by_name():
    from qkv.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="init"):
        ModelConfig(init="kaiming").validate()

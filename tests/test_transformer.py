import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.config import MODEL_PRESETS, ModelConfig
from qkv.info import parameter_breakdown, transformer_flops
from qkv.masks import padding_mask
from qkv.models import build_model
from qkv.models.transformer import Transformer


def tiny(**kw) -> ModelConfig:
    return dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=40, tgt_vocab_size=40, **kw)


def closed_form_parameters(d: int, d_ff: int, n: int, v: int) -> int:
    """The paper's architecture counted by hand: shared embedding, biases, LayerNorm gain+bias."""
    attention = 4 * (d * d + d)  # W^Q, W^K, W^V, W^O with biases
    ffn = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return v * d + n * encoder_layer + n * decoder_layer


@pytest.mark.parametrize("name", ["tiny", "small", "base", "big"])
def test_parameter_count_matches_closed_form(name):
    cfg = dataclasses.replace(MODEL_PRESETS[name], src_vocab_size=37000, tgt_vocab_size=37000)
    with torch.device("meta"):
        model = Transformer(cfg)
    parts = parameter_breakdown(model)
    expected = closed_form_parameters(cfg.d_model, cfg.d_ff, cfg.n_encoder_layers, 37000)
    assert parts["total"] == expected
    assert parts["embeddings (shared)"] == 37000 * cfg.d_model
    if name == "base":
        assert parts["total"] == 63_082_496  # the paper reports ~65M for base (Table 3)


def test_flops_formula_by_hand():
    cfg = tiny()  # d=32, d_ff=64, 2+2 layers, V=40
    d, f, s, t, v = 32, 64, 3, 2, 40
    enc = 2 * (8 * d * d * s + 4 * d * f * s + 4 * s * s * d)
    dec = 2 * (8 * d * d * t + 4 * t * t * d + 4 * d * d * t + 4 * d * d * s + 4 * t * s * d + 4 * d * f * t)
    fl = transformer_flops(cfg, s, t)
    assert fl.forward == pytest.approx((enc + dec + 2 * d * v * t) / t)
    assert fl.training == pytest.approx(3 * fl.forward)


def test_embeddings_are_scaled_and_shared():
    torch.manual_seed(0)
    m = Transformer(tiny())
    assert m.src_embed is m.tgt_embed and m.output_proj is None
    tokens = torch.tensor([[5, 6]])
    assert torch.allclose(m.src_embed(tokens), m.src_embed.weight[tokens] * math.sqrt(32))
    x = torch.randn(1, 2, 32)
    assert torch.allclose(m._logits(x), x @ m.src_embed.weight.T)
    untied = Transformer(tiny(share_embeddings=False, tie_output=False))
    assert untied.src_embed is not untied.tgt_embed and untied.output_proj is not None


def test_post_norm_layer_is_layernorm_of_residual_sum():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    layer = m.encoder_layers[0]
    x = torch.randn(2, 5, 32)
    mask = padding_mask(torch.tensor([[4] * 5, [4, 4, 4, 0, 0]]))
    a, _, _ = layer.self_attn.self_attention(x, mask=mask)
    h = F.layer_norm(x + a, (32,), layer.res_attn.norm.weight, layer.res_attn.norm.bias)
    f = layer.ffn.w_2(torch.relu(layer.ffn.w_1(h)))
    expected = F.layer_norm(h + f, (32,), layer.res_ffn.norm.weight, layer.res_ffn.norm.bias)
    out, _, _ = layer(x, mask)
    assert torch.allclose(out, expected, atol=1e-6)


def test_pre_norm_layer():
    torch.manual_seed(0)
    m = Transformer(tiny(norm_first=True)).eval()
    layer = m.encoder_layers[0]
    x = torch.randn(1, 4, 32)
    n1 = layer.res_attn.norm(x)
    h = x + layer.self_attn.self_attention(n1)[0]
    expected = h + layer.ffn(layer.res_ffn.norm(h))
    assert torch.allclose(layer(x)[0], expected, atol=1e-6)
    assert isinstance(m.encoder_norm, torch.nn.LayerNorm)


@pytest.mark.parametrize("kw", [{}, {"norm_first": True}, {"positional": "learned"},
                                {"share_embeddings": False, "tie_output": False}])
def test_incremental_decoding_equals_full_recomputation(kw):
    torch.manual_seed(0)
    m = Transformer(tiny(**kw)).eval()
    src = torch.randint(4, 40, (3, 7))
    src[1, 4:] = 0
    tgt = torch.randint(4, 40, (3, 6))
    tgt[:, 0] = 2
    with torch.no_grad():
        full = m(src, tgt)  # (B, T, V)
        state = m.start(src)
        steps = []
        for t in range(6):
            logits, state = m.step(tgt[:, t], state)
            steps.append(logits)
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-5)
    assert state.self_kv[0].k.shape[2] == 6


def test_padding_does_not_change_the_output():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    src = torch.tensor([[7, 8, 9, 3]])
    tgt = torch.tensor([[2, 5, 6]])
    padded = torch.tensor([[7, 8, 9, 3, 0, 0]])
    with torch.no_grad():
        assert torch.allclose(m(src, tgt), m(padded, tgt), atol=1e-5)


def test_future_target_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    src = torch.randint(4, 40, (1, 5))
    a = torch.tensor([[2, 5, 6, 7]])
    b = torch.tensor([[2, 5, 6, 30]])
    with torch.no_grad():
        assert torch.allclose(m(src, a)[:, :3], m(src, b)[:, :3], atol=1e-6)


def test_attention_maps_rows_sum_to_one():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    src = torch.tensor([[5, 6, 7, 3, 0]])
    maps = m.attention_maps(src, torch.tensor([[2, 8, 9]]))
    assert len(maps.encoder) == 2 and maps.cross[0].shape == (1, 2, 3, 5)
    for w in maps.encoder + maps.decoder_self + maps.cross:
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-6)
    assert (maps.cross[0][..., 4] == 0).all()


def test_build_model_and_config_errors():
    assert isinstance(build_model(tiny()), Transformer)
    from qkv.errors import ConfigError

    with pytest.raises(ConfigError, match="n_heads"):
        tiny(n_heads=5).validate()
    with pytest.raises(ConfigError, match="dropout"):
        tiny(dropout=1.5).validate()


def test_beam_one_equals_greedy_and_cached_decoding_equals_recomputation_on_the_real_model():
    from qkv.decoding import beam_search, greedy

    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    src = torch.randint(4, 40, (4, 6))
    src[2, 3:] = 0
    max_len = torch.tensor([8, 8, 5, 8])
    g = greedy(m, src, max_len)
    b = beam_search(m, src, beam_size=1, length_penalty=0.6, max_len=max_len)
    assert [h[0].tokens for h in b] == g
    # greedy through the cache == argmax of full recomputation over the growing prefix
    with torch.no_grad():
        for i in range(4):
            prefix = [2]
            for _ in range(int(max_len[i])):
                logits = m(src[i : i + 1], torch.tensor([prefix]))[0, -1]
                logits[0] = logits[2] = float("-inf")  # PAD and BOS are never emitted
                tok = int(logits.argmax())
                if tok == 3:
                    break
                prefix.append(tok)
            assert prefix[1:] == g[i]


def stack_step(m: Transformer, tokens: torch.Tensor, state):
    """One decoding step through the decoder stack as training runs it (``(B, 1, d)`` rows, the
    modules called, the boolean padding mask): what ``step`` did before its eval path."""
    x, self_kv, _ = m.decoder(tokens[:, None], state.position, caches=state.self_kv, memory_kv=state.cross_kv,
                              memory_mask=state.memory_mask, beam=state.beam)
    return m._logits(x)[:, 0], dataclasses.replace(state, self_kv=self_kv, position=state.position + 1)


@pytest.mark.parametrize("kw,beam,int8", [({}, 1, False), ({}, 3, False), ({"norm_first": True}, 3, False),
                                          ({"positional": "learned"}, 1, False),
                                          ({"share_embeddings": False, "tie_output": False}, 2, False),
                                          ({}, 3, True)])
def test_eval_step_gives_the_stacks_logits_bit_for_bit(kw, beam, int8):
    """The lean eval-mode step (2-D rows, no module calls, additive mask made once) computes the
    same logits as the stack, exactly: through beam reorders and dropped sentences."""
    from qkv.frontends.quantize import quantize_int8

    torch.manual_seed(0)
    m = Transformer(tiny(dropout=0.0, attention_dropout=0.0, **kw)).eval()
    if int8:
        quantize_int8(m, min_weights=0)
    src = torch.randint(4, 40, (4, 7))
    src[1, 4:] = 0
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        lean = m.start(src)
        lean = lean.expand_beams(beam) if beam > 1 else lean
        ref, n = lean, 4
        tokens = torch.full((4 * beam,), 2)
        for t in range(7):
            got, lean = m.step(tokens, lean)
            want, ref = stack_step(m, tokens, ref)
            assert torch.equal(got, want), f"step {t}: {(got - want).abs().max()}"
            if t % 3 == 2:  # a sentence done: dropped; the others follow back-pointers
                n -= 1
                rows = (torch.arange(1, n + 1).unsqueeze(1) * beam + torch.randint(0, beam, (n, beam), generator=g))
                lean, ref, tokens = lean.reorder(rows.view(-1)), ref.reorder(rows.view(-1)), tokens[rows.view(-1)]
            tokens = torch.randint(4, 40, tokens.shape, generator=g)

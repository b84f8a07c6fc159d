"""The decoder-only Transformer: causal, incremental == full forward, batched prefixes == alone."""

import dataclasses

import pytest
import torch

from qkv.config import BOS, EOS, MODEL_PRESETS, PAD
from qkv.decoding import beam_search, greedy
from qkv.models.decoder_only import DecoderOnlyTransformer

V = 30


def model(seed=0, sep_id=None, **kw) -> DecoderOnlyTransformer:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=V, tgt_vocab_size=V, **kw)
    return DecoderOnlyTransformer(cfg, sep_id=sep_id).eval()


@pytest.mark.parametrize("norm_first", [False, True])
def test_causal_later_tokens_never_change_earlier_logits(norm_first):
    m = model(norm_first=norm_first)
    x = torch.randint(4, V, (2, 9))
    y = x.clone()
    y[:, 5:] = torch.randint(4, V, (2, 4))
    a, b = m(x), m(y)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-3)  # the change is visible where it may be


def test_causal_attention_weights_are_lower_triangular():
    m = model()
    _, weights = m(torch.randint(4, V, (1, 6)), need_weights=True)
    for w in weights:
        assert torch.all(w.triu(1) == 0)
        assert torch.allclose(w.sum(-1), torch.ones(1, 2, 6))


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_incremental_equals_full_forward(positional):
    m = model(positional=positional)
    x = torch.randint(4, V, (3, 10))
    full = m(x)  # (B, T, V)
    for p in (0, 1, 4):  # prefix lengths, the empty prefix included
        state = m.start(x[:, :p])
        for t in range(p, 10):
            logits, state = m.step(x[:, t], state)
            assert torch.allclose(logits, full[:, t], atol=1e-5), (p, t)


def test_batched_variable_prefixes_equal_each_row_alone():
    m = model()
    rows = [[5, 6, 7, 8, 9], [10, 11], [12], [13, 14, 15]]
    cont = torch.randint(4, V, (len(rows), 4))
    batch = torch.full((len(rows), 5), PAD)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r)
    state = m.start(batch)
    assert state.positions.tolist() == [5, 2, 1, 3]
    batched = []
    for t in range(4):
        logits, state = m.step(cont[:, t], state)
        batched.append(logits)
    for i, r in enumerate(rows):
        # alone, without padding, through the full forward: the reference
        alone = m(torch.tensor([r + cont[i].tolist()]))[0, len(r) :]  # (4, V)
        for t in range(4):
            assert torch.allclose(batched[t][i], alone[t], atol=1e-5), (i, t)


def test_reorder_selects_rows():
    m = model()
    x = torch.randint(4, V, (3, 4))
    state = m.start(x)
    idx = torch.tensor([2, 0])
    a, _ = m.step(torch.tensor([5, 6]), state.reorder(idx))
    b, _ = m.step(torch.tensor([5, 6]), m.start(x[idx]))
    assert torch.allclose(a, b, atol=1e-6)


def test_prefix_lm_start_appends_separator_and_decoders_run():
    sep = 4
    m = model(sep_id=sep)
    src = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    assert m.with_separator(src).tolist() == [[5, 6, 7, sep], [8, sep, PAD, PAD]]
    # the first step after start(src) is BOS, as the training sequence src <sep> BOS tgt EOS
    logits, _ = m.step(torch.full((2,), BOS), m.start(src))
    full = m(torch.tensor([[5, 6, 7, sep, BOS]]))[0, -1]
    assert torch.allclose(logits[0], full, atol=1e-5)
    g = greedy(m, src, max_len=6)
    b = beam_search(m, src, beam_size=1, length_penalty=0.0, max_len=6)
    assert g == [h[0].tokens for h in b]
    assert all(EOS not in row and len(row) <= 6 for row in g)


def test_tied_output_and_parameter_count():
    m = model()
    d, f, n = 32, 64, 2
    layer = 4 * (d * d + d) + (d * f + f + f * d + d) + 2 * 2 * d
    assert sum(p.numel() for p in m.parameters()) == V * d + n * layer
    x = torch.randn(1, 2, d)
    assert torch.allclose(m._logits(x), x @ m.embed.weight.T)

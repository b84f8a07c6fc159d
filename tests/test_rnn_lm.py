"""The recurrent language model: incremental == full forward, batched prefixes == alone, tying."""

import dataclasses

import pytest
import torch

from qkv.config import MODEL_PRESETS, PAD
from qkv.decoding import beam_search, greedy
from qkv.models.rnn_lm import RNNLanguageModel

V = 25


def model(kind, seed=0, **kw) -> RNNLanguageModel:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=V, tgt_vocab_size=V, **kw)
    return RNNLanguageModel(cfg, kind=kind).eval()


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_incremental_equals_full_forward_and_state_carries(kind):
    m = model(kind)
    x = torch.randint(4, V, (2, 8))
    full, final = m(x)
    # two windows with the state carried equal one pass (what truncated BPTT relies on)
    a, s = m(x[:, :5])
    b, s = m(x[:, 5:], s)
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
    assert torch.allclose(s.h, final.h, atol=1e-5)
    for p in (0, 3):
        state = m.start(x[:, :p])
        for t in range(p, 8):
            logits, state = m.step(x[:, t], state)
            assert torch.allclose(logits, full[:, t], atol=1e-5)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_batched_variable_prefixes_equal_each_row_alone(kind):
    m = model(kind)
    rows = [[5, 6, 7, 8], [9], [], [10, 11]]
    batch = torch.full((4, 4), PAD)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    nxt = torch.tensor([12, 13, 14, 15])
    logits, _ = m.step(nxt, m.start(batch))
    for i, r in enumerate(rows):
        alone, _ = m(torch.tensor([r + [int(nxt[i])]]))
        assert torch.allclose(logits[i], alone[0, -1], atol=1e-5), i


def test_tied_output_shares_the_embedding():
    m = model("lstm")
    assert m.output_proj is None
    h = torch.randn(1, 1, 32)
    assert torch.allclose(m._logits(h), h @ m.embed.weight.T + m.output_bias)
    untied = model("lstm", tie_output=False)
    assert untied.output_proj is not None


def test_decoders_run_and_beam_one_is_greedy():
    m = model("gru")
    src = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    g = greedy(m, src, max_len=5)
    b = beam_search(m, src, beam_size=1, length_penalty=0.0, max_len=5)
    assert g == [h[0].tokens for h in b]


def test_reorder_selects_rows():
    m = model("lstm")
    x = torch.randint(4, V, (3, 4))
    idx = torch.tensor([2, 0])
    a, _ = m.step(torch.tensor([5, 6]), m.start(x).reorder(idx))
    b, _ = m.step(torch.tensor([5, 6]), m.start(x[idx]))
    assert torch.allclose(a, b, atol=1e-6)

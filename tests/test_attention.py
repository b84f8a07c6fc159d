import math

import torch
import torch.nn.functional as F
from torch import nn

from qkv.masks import causal_mask, padding_mask
from qkv.nn.attention import KVCache, MultiHeadAttention, attention_reference, scaled_dot_product_attention


def test_reference_matches_hand_computation():
    # one head, one query, two keys: scores q.k / sqrt(d_k)
    q = torch.tensor([[[[1.0, 0.0]]]])  # (1, 1, 1, 2)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = torch.tensor([[[[10.0, 0.0], [0.0, 20.0]]]])
    out, w = attention_reference(q, k, v)
    s = 1 / math.sqrt(2)
    w0 = math.exp(s) / (math.exp(s) + 1)
    assert torch.allclose(w[0, 0, 0], torch.tensor([w0, 1 - w0]))
    assert torch.allclose(out[0, 0, 0], torch.tensor([10 * w0, 20 * (1 - w0)]))


def test_fast_path_equals_reference_with_masks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    mask = padding_mask(torch.tensor([[4, 4, 4, 3, 0], [4, 3, 0, 0, 0]]))
    for m, causal in [(mask, False), (None, True), (mask, True)]:
        fast, _ = scaled_dot_product_attention(q, k, v, m, is_causal=causal)
        ref, w = attention_reference(q, k, v, m, is_causal=causal)
        assert torch.allclose(fast, ref, atol=1e-5)
        assert torch.allclose(w.sum(-1), torch.ones(2, 3, 5))  # rows sum to 1 over visible keys
    _, w = attention_reference(q, k, v, mask & causal_mask(5))
    assert (w[1, :, :, 2:] == 0).all()  # padding gets no weight
    assert (w[0].triu(1) == 0).all()  # the future gets no weight


def _copy_to_torch_mha(mine: MultiHeadAttention) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(mine.d_model, mine.n_heads, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(mine.in_proj.weight)
        ref.in_proj_bias.copy_(mine.in_proj.bias)
        ref.out_proj.weight.copy_(mine.out_proj.weight)
        ref.out_proj.bias.copy_(mine.out_proj.bias)
    return ref.eval()


def test_self_attention_matches_torch_multihead_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    ref = _copy_to_torch_mha(mha)
    x = torch.randn(2, 6, 16)
    tokens = torch.tensor([[5] * 6, [5, 5, 5, 0, 0, 0]])
    out, _, w = mha.self_attention(x, mask=padding_mask(tokens), need_weights=True)
    ref_out, ref_w = ref(x, x, x, key_padding_mask=tokens == 0, average_attn_weights=False)
    assert torch.allclose(out[:, :], ref_out, atol=1e-5)
    assert torch.allclose(w, ref_w, atol=1e-6)
    fast, _, none = mha.self_attention(x, mask=padding_mask(tokens))
    assert none is None and torch.allclose(fast, ref_out, atol=1e-5)


def test_causal_self_attention_matches_torch():
    torch.manual_seed(1)
    mha = MultiHeadAttention(8, 2).eval()
    ref = _copy_to_torch_mha(mha)
    x = torch.randn(3, 5, 8)
    out, _, _ = mha.self_attention(x, causal=True)
    blocked = ~causal_mask(5)[0, 0]  # torch: True = blocked
    ref_out, _ = ref(x, x, x, attn_mask=blocked)
    assert torch.allclose(out, ref_out, atol=1e-5)


def test_cross_attention_matches_torch_and_cached_kv():
    torch.manual_seed(2)
    mha = MultiHeadAttention(8, 2).eval()
    ref = _copy_to_torch_mha(mha)
    x, mem = torch.randn(2, 3, 8), torch.randn(2, 7, 8)
    src = torch.tensor([[5] * 7, [5] * 4 + [0] * 3])
    kv = mha.project_kv(mem)
    assert kv.k.shape == kv.v.shape == (2, 2, 7, 4)  # (B, h, S, d_k)
    out, w = mha.cross_attention(x, kv, mask=padding_mask(src), need_weights=True)
    ref_out, ref_w = ref(x, mem, mem, key_padding_mask=src == 0, average_attn_weights=False)
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert torch.allclose(w, ref_w, atol=1e-6) and (w[1, :, :, 4:] == 0).all()


def test_cross_attention_reuses_the_memory_keys_values_across_steps():
    """The memory's K/V projected once (decoding) give, step after step, what projecting the memory
    again for every query gives (the whole target at once, as in training)."""
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 2).eval()
    x, mem = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    mask = padding_mask(torch.tensor([[5] * 7, [5] * 3 + [0] * 4]))
    whole, _ = mha.cross_attention(x, mha.project_kv(mem), mask)
    kv = mha.project_kv(mem)
    steps = [mha.cross_attention(x[:, t : t + 1], kv, mask)[0] for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-6, rtol=1e-6)
    assert mha.project_kv(mem).k.equal(kv.k)  # nothing of a call is kept: the K/V are the caller's


def test_cross_attention_of_beams_equals_repeated_memory():
    """beam=k: k query rows per memory row attend to that row's K/V, never copied per hypothesis."""
    torch.manual_seed(5)
    mha = MultiHeadAttention(8, 2).eval()
    n, k = 3, 4
    x, mem = torch.randn(n * k, 1, 8), torch.randn(n, 6, 8)
    mask = padding_mask(torch.tensor([[5] * 6, [5] * 2 + [0] * 4, [5] * 5 + [0]]))
    kv = mha.project_kv(mem)
    grouped, w = mha.cross_attention(x, kv, mask, need_weights=True, beam=k)
    rows = torch.arange(n).repeat_interleave(k)
    copied, w_copied = mha.cross_attention(x, kv.reorder(rows), mask[rows], need_weights=True)
    torch.testing.assert_close(grouped, copied, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, w_copied)


def test_incremental_self_attention_equals_full_causal():
    torch.manual_seed(3)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 4, 8)
    full, _, _ = mha.self_attention(x, causal=True)
    cache = mha.empty_cache(2, x)
    assert cache.k.shape == (2, 2, 0, 4)
    outs = []
    for t in range(4):
        o, cache, _ = mha.self_attention(x[:, t : t + 1], cache=cache)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5)
    assert cache.k.shape == (2, 2, 4, 4)


def test_causal_self_attention_with_a_cache_continues_the_sequence():
    """Several new positions at once after a cache: each sees the cache and the new positions up
    to its own (the causal mask of the last T_q of T_k positions), with or without the weights."""
    torch.manual_seed(6)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 7, 8)
    full, _, w_full = mha.self_attention(x, causal=True, need_weights=True)
    _, cache, _ = mha.self_attention(x[:, :3], causal=True, cache=mha.empty_cache(2, x))
    for need_weights in (False, True):
        rest, grown, w = mha.self_attention(x[:, 3:], causal=True, cache=cache, need_weights=need_weights)
        torch.testing.assert_close(rest, full[:, 3:], atol=1e-5, rtol=1e-5)
        assert grown.k.shape == (2, 2, 7, 4)
    torch.testing.assert_close(w, w_full[:, :, 3:])


def test_attention_dropout_only_in_training():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(1, 5, 8)
    mha.eval()
    a, _, _ = mha.self_attention(x)
    b, _, _ = mha.self_attention(x)
    assert torch.equal(a, b)
    mha.train()
    c, _, _ = mha.self_attention(x)
    assert not torch.allclose(a, c)


def test_kv_cache_grows_in_place_and_branches_safely():
    """append writes into spare room (no copy of the past) and equals torch.cat; a state that is
    appended to twice (a branch) keeps both results right; reorder copies the filled rows."""
    torch.manual_seed(0)
    steps = [(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)) for _ in range(40)]  # > GROW: one regrowth
    empty = torch.zeros(3, 2, 0, 4)
    cache, ref_k, ref_v = KVCache(empty, empty), empty, empty
    states = []
    for k, v in steps:
        cache = cache.append(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        assert torch.equal(cache.k, ref_k) and torch.equal(cache.v, ref_v)
        states.append((cache, ref_k, ref_v))
    first, second = states[5][0].append(*steps[0]), states[6][0]  # branch from an older state
    assert first.k.data_ptr() != second.k.data_ptr()  # the branch was copied, not written over
    assert torch.equal(first.k, torch.cat([states[5][1], steps[0][0]], dim=2))
    for c, k, v in states:  # every earlier state still holds its own keys and values
        assert torch.equal(c.k, k) and torch.equal(c.v, v)
    last_k = states[-1][0].k
    assert states[-2][0].k.data_ptr() == last_k.data_ptr()  # consecutive states share one buffer
    idx = torch.tensor([2, 2, 0])
    moved = cache.reorder(idx)
    assert torch.equal(moved.k, ref_k.index_select(0, idx)) and torch.equal(moved.v, ref_v.index_select(0, idx))
    k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    grown = moved.append(k, v)
    assert torch.equal(grown.k, torch.cat([ref_k.index_select(0, idx), k], dim=2))
    assert torch.equal(cache.k, ref_k)  # the reorder did not touch the original


def test_training_attention_on_the_cpu_is_unbiased_and_keeps_sdpas_empty_rows():
    """On the CPU in training (dropout > 0) eq. 1 is written out so that its dropout draws qkv's
    masks: averaged over many draws it equals torch's SDPA without dropout, and a query that may
    attend to no key gets output 0 (SDPA's answer), not NaN, with finite gradients."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, :, :, 3:] = False  # padding keys
    mask[1, :, 2] = False  # query 2 of sentence 1 may attend to nothing
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(expected[1, :, 2], torch.zeros(2, 4))  # torch's own answer for an empty row
    draws = torch.stack([scaled_dot_product_attention(q, k, v, mask, 0.2)[0] for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0), expected, atol=0.05, rtol=0)
    assert torch.equal(draws[:, 1, :, 2], torch.zeros_like(draws[:, 1, :, 2]))
    qg = q.clone().requires_grad_()
    scaled_dot_product_attention(qg, k, v, mask, 0.2)[0].sum().backward()
    assert torch.isfinite(qg.grad).all()

import math

import pytest
import torch

from qkv.cli import main
from qkv.complexity import (
    PeakMemory, count_flops, crossover, expected_path_length, fit_exponent, make_layer, measure_layers,
    path_length, sequential_steps, summarize,
)
from qkv.masks import local_block_mask, local_mask
from qkv.nn.attention import attention_reference
from qkv.nn.restricted_attention import RestrictedSelfAttention


# --- masks -------------------------------------------------------------------------------------------

def test_local_mask_is_the_band():
    m = local_mask(5, 1)
    assert m.shape == (1, 1, 5, 5) and m.dtype == torch.bool
    assert m[0, 0].int().tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1],
    ]
    assert local_mask(4, 0)[0, 0].equal(torch.eye(4, dtype=torch.bool))
    with pytest.raises(ValueError):
        local_mask(4, -1)


@pytest.mark.parametrize("n, r", [(10, 3), (9, 3), (4, 5), (7, 1)])
def test_local_block_mask_holds_the_same_band(n, r):
    blocks = local_block_mask(n, r)  # (n_blocks, r, 3r)
    dense = torch.zeros(n, n, dtype=torch.bool)
    for b in range(blocks.size(0)):
        for i in range(r):
            for j in range(3 * r):
                p, s = b * r + i, (b - 1) * r + j
                if blocks[b, i, j] and p < n:  # queries p >= n are padding, dropped after attention
                    assert 0 <= s < n
                    dense[p, s] = True
    assert dense.equal(local_mask(n, r)[0, 0])
    assert blocks.any(dim=-1).all()  # every (padded) query keeps a key


# --- restricted attention ----------------------------------------------------------------------------

@pytest.mark.parametrize("n, r", [(13, 3), (16, 4), (5, 8)])
def test_restricted_attention_blocked_equals_masked_eq1(n, r):
    torch.manual_seed(0)
    layer = RestrictedSelfAttention(16, 4, r)
    x = torch.randn(2, n, 16)
    mha = layer.attn
    q, k, v = (mha._split(t) for t in mha.in_proj(x).chunk(3, dim=-1))
    ref, _ = attention_reference(q, k, v, local_mask(n, r))  # eq. 1 written out, band-masked
    ref = mha.out_proj(ref.transpose(1, 2).reshape(2, n, 16))
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    layer.dense = True
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)


# --- FLOPs -------------------------------------------------------------------------------------------

def _flops(kind, n, d=32, **kw):
    layer = make_layer(kind, d, n_heads=4, **kw)
    return count_flops(layer, torch.randn(1, n, d, requires_grad=True))


def test_attention_flops_are_the_formula_and_grow_as_n_squared():
    d = 32
    for n in (16, 64):
        fwd, bwd = _flops("attention-core", n, d)
        assert fwd == 4 * n * n * d  # QKᵀ and AV: n·n·d multiply-adds each, 2 FLOPs per multiply-add
        assert bwd == 10 * n * n * d  # torch's SDPA backward: 5 matmuls of n·n·d
        fwd, _ = _flops("self-attention", n, d)
        assert fwd == 8 * n * d * d + 4 * n * n * d  # plus Q, K, V, output projections
    assert _flops("attention-core", 128)[0] / _flops("attention-core", 64)[0] == 4


def test_recurrent_and_conv_flops_grow_as_n():
    d, n = 32, 40
    lstm, _ = _flops("lstm", n, d)
    assert lstm == 16 * n * d * d  # counted, although CPU's fused oneDNN LSTM is invisible to the counter
    assert _flops("lstm", 2 * n, d)[0] == 2 * lstm
    assert _flops("rnn", n, d)[0] == 4 * n * d * d
    assert _flops("conv", n, d, k=3)[0] == 2 * 3 * n * d * d
    assert _flops("restricted", 64, d, r=8)[0] == 8 * 64 * d * d + 12 * 8 * 64 * d  # O(r·n·d)
    assert _flops("restricted-dense", 64, d, r=8)[0] == 8 * 64 * d * d + 4 * 64 * 64 * d  # still n²


# --- sequential steps, memory --------------------------------------------------------------------------

def test_sequential_steps_grow_with_n_for_recurrence_only():
    def steps(kind, n):
        return sequential_steps(make_layer(kind, 16, n_heads=4, r=4), torch.randn(1, n, 16))

    for kind in ("lstm", "rnn"):
        a, b, c = steps(kind, 10), steps(kind, 20), steps(kind, 40)
        assert c - b == 2 * (b - a) > 0  # linear in n
    for kind in ("self-attention", "restricted", "conv"):
        assert steps(kind, 10) == steps(kind, 40)


def test_peak_memory_counts_live_tensors_only():
    with PeakMemory() as m:
        a = torch.ones(1000)  # 4,000 bytes
        b = torch.ones(500)  # + 2,000
        del a, b
        c = torch.ones(250)  # after the frees: 1,000 live
        c.add_(1)  # in place: nothing new
        v = c.view(5, 50)  # a view: nothing new
    assert m.peak == 6000 and m.current == 1000
    del c, v


# --- path length ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 5, 9, 17])
def test_path_length_is_found_from_gradients(n):
    assert path_length("self-attention", n) == 1
    assert path_length("conv", n, k=3) == math.ceil((n - 1) / 2)
    assert path_length("conv", n, k=4) == math.ceil((n - 1) / 3)
    assert path_length("conv-dilated", n, k=2) == math.ceil(math.log2(n))
    assert path_length("restricted", n, r=3) == math.ceil((n - 1) / 3)
    assert path_length("restricted-dense", n, r=3) == math.ceil((n - 1) / 3)
    assert path_length("lstm", n) == n - 1
    assert path_length("rnn", n) == n - 1


def test_expected_path_length_matches_at_a_long_sequence():
    assert path_length("conv-dilated", 100, k=3) == expected_path_length("conv-dilated", 100, 64, 3) == 5
    assert path_length("restricted", 300, r=16) == expected_path_length("restricted", 300, 16, 3) == 19


# --- fits and the sweep --------------------------------------------------------------------------------

def test_fit_exponent_and_crossover():
    ns = [16, 32, 64, 128]
    assert fit_exponent(ns, [3 * n**2 for n in ns]) == pytest.approx(2.0)
    assert fit_exponent(ns, [n for n in ns], n_from=64) == pytest.approx(1.0)
    assert crossover(ns, [n * n for n in ns], [50 * n for n in ns]) == pytest.approx(50.0)
    assert crossover(ns, [n for n in ns], [2 * n for n in ns]) is None


def test_measure_layers_small_sweep():
    res = measure_layers(d=16, ns=[8, 16, 32], r=2, k=3, n_heads=2, repeats=1)
    s = summarize(res)
    assert set(s["exponents"]) == {"self-attention", "attention-core", "restricted", "restricted-dense", "lstm",
                                   "rnn", "conv", "conv-dilated"}
    assert all(row["path_matches"] for row in s["exponents"].values())
    assert s["exponents"]["attention-core"]["flops"] == pytest.approx(2.0)
    assert s["exponents"]["lstm"]["flops"] == pytest.approx(1.0, abs=0.05)
    assert s["exponents"]["lstm"]["sequential_steps"] > 0.9
    assert s["exponents"]["conv"]["sequential_steps"] == pytest.approx(0.0)


def test_cli_bench_layers_writes_outputs(tmp_path, capsys):
    rc = main(["bench", "layers", "--d", "16", "--heads", "2", "--n-min", "8", "--n-max", "16", "--r", "2",
               "--layers", "self-attention,lstm", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    assert {p.name for p in tmp_path.iterdir()} == {"complexity.json", "complexity.md", "complexity.png"}
    assert "| lstm" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [(["--r", "0"], "--r must be a whole number from 1"), (["--layers", "gru"], "unknown layer type"),
                                             (["--d", "30"], "multiple of the number of heads")])
def test_cli_bench_layers_rejects_bad_values(tmp_path, capsys, flags, message):
    rc = main(["bench", "layers", "--n-min", "8", "--n-max", "8", "--out", str(tmp_path), *flags])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_bench_without_matplotlib_fails_before_measuring(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    rc = main(["bench", "layers", "--d", "16", "--heads", "2", "--n-min", "8", "--n-max", "8",
               "--out", str(tmp_path / "b")])
    assert rc == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()

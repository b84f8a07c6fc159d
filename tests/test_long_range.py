import pytest
import torch

from qkv.cli import main
from qkv.long_range import (
    PREFIX, TransformerClassifier, build_model, input_gradient_norms, last_position, make_batch, sequence_length,
    train_one,
)


@pytest.mark.parametrize("t", [1, 3, 50])
def test_the_label_is_the_symbol_t_positions_before_the_end(t):
    tokens, labels = make_batch(64, t, 8, torch.Generator().manual_seed(t))
    T = sequence_length(t)
    assert tokens.shape == (64, T) and T == t + PREFIX + 1
    assert labels.equal(tokens[:, T - 1 - t])  # 1-based position T - t
    assert tokens.min() >= 0 and tokens.max() < 8
    # the other positions are distractors: not equal to the label in general
    assert not labels.equal(tokens[:, T - 2 - t]) and not labels.equal(tokens[:, -1])


def test_make_batch_rejects_bad_values():
    with pytest.raises(ValueError):
        make_batch(4, 0, 8, torch.Generator())
    with pytest.raises(ValueError):
        make_batch(4, 3, 1, torch.Generator())


def test_last_position_is_the_full_layer_last_row():
    torch.manual_seed(0)
    model = TransformerClassifier(8, 16, n_heads=4, n_layers=1)
    layer = model.layers[0]
    x = torch.randn(3, 11, 16)
    x.requires_grad_()
    full, _, _ = layer(x)
    last = last_position(layer, x)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-6)
    (g_full,) = torch.autograd.grad(full[:, -1].sum(), x)  # and so are the gradients
    (g_last,) = torch.autograd.grad(last.sum(), x)
    torch.testing.assert_close(g_last, g_full, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["rnn", "lstm", "transformer"])
def test_gradient_probe_returns_a_norm_per_position(name):
    torch.manual_seed(0)
    model = build_model(name, 8, 16)
    tokens, labels = make_batch(5, 6, 8, torch.Generator().manual_seed(1))
    norms = input_gradient_norms(model, tokens, labels)
    assert norms.shape == (tokens.size(1),) and (norms > 0).all()
    # independent reference: each sequence's own loss, its own gradient, by autograd.grad, averaged
    ref = torch.zeros(tokens.size(1), dtype=torch.float64)
    m64 = model.double()
    for i in range(5):
        x = m64.embed(tokens[i : i + 1]).detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(m64.classify(x), labels[i : i + 1])
        (g,) = torch.autograd.grad(loss, x)
        ref += g[0].norm(dim=-1) / 5
    torch.testing.assert_close(norms, ref)


def test_rnn_gradient_vanishes_with_distance_at_init():
    torch.manual_seed(0)
    model = build_model("rnn", 8, 32)
    tokens, labels = make_batch(50, 60, 8, torch.Generator().manual_seed(0))
    norms = input_gradient_norms(model, tokens, labels)
    assert norms[0] < 1e-6 * norms[-1]  # 64 steps back: orders of magnitude smaller


def test_a_tiny_lstm_learns_t3():
    run = train_one("lstm", 3, steps=300, hidden=32, lr=1e-2, batch=32, n_eval=300, n_probe=50)
    assert run.accuracy > 0.9  # chance is 1/8
    assert run.grad_norm_init > 0 and run.grad_norm_trained > 0


def test_cli_bench_long_range(tmp_path, capsys):
    rc = main(["bench", "long-range", "--distances", "2", "--steps", "3", "--hidden", "8",
               "--models", "rnn,transformer", "--out", str(tmp_path)])
    assert rc == 0
    assert {p.name for p in tmp_path.iterdir()} == {"long-range.json", "long-range.md", "long-range-accuracy.png",
                                                    "long-range-gradnorm.png"}
    assert "rnn accuracy" in capsys.readouterr().out
    assert main(["bench", "long-range", "--models", "gru", "--out", str(tmp_path)]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_cli_bench_long_range_rejects_bad_distances(tmp_path, capsys):
    assert main(["bench", "long-range", "--distances", "5,x", "--out", str(tmp_path)]) == 2
    assert "--distances" in capsys.readouterr().err
    assert main(["bench", "long-range", "--distances", "0", "--out", str(tmp_path)]) == 2
    assert "distances must be >= 1" in capsys.readouterr().err

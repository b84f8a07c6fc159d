"""Recurrent cells and layers against torch's own modules (copied weights) and hand-written math."""

import pytest
import torch
from torch import nn

from qkv.nn.recurrent import GRUCell, LSTMCell, Recurrent, RNNCell, RNNState, final_states

ATOL = 1e-5


def copy_cell(cell: nn.Module, ref: nn.Module) -> None:
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).copy_(getattr(ref, name))


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_cell_matches_torch(nonlinearity):
    torch.manual_seed(0)
    ref = nn.RNNCell(5, 7, nonlinearity=nonlinearity)
    cell = RNNCell(5, 7, nonlinearity)
    copy_cell(cell, ref)
    x, h = torch.randn(3, 5), torch.randn(3, 7)
    assert torch.allclose(cell(x, h), ref(x, h), atol=ATOL)


def test_rnn_cell_by_hand():
    cell = RNNCell(1, 1, "relu")
    with torch.no_grad():
        cell.weight_ih.fill_(2.0)  # U
        cell.weight_hh.fill_(-3.0)  # V
        cell.bias_ih.fill_(0.5)
        cell.bias_hh.fill_(0.25)  # b_h = 0.75
    # relu(-3 * 1 + 2 * 4 + 0.75) = 5.75; relu(-3 * 3 + 2 * 1 + 0.75) = 0
    out = cell(torch.tensor([[4.0], [1.0]]), torch.tensor([[1.0], [3.0]]))
    assert out.squeeze(1).tolist() == [5.75, 0.0]


def test_lstm_cell_matches_torch_and_the_equations():
    torch.manual_seed(0)
    ref = nn.LSTMCell(4, 6)
    cell = LSTMCell(4, 6)
    copy_cell(cell, ref)
    x, h, c = torch.randn(2, 4), torch.randn(2, 6), torch.randn(2, 6)
    h1, c1 = cell(x, (h, c))
    rh, rc = ref(x, (h, c))
    assert torch.allclose(h1, rh, atol=ATOL) and torch.allclose(c1, rc, atol=ATOL)
    # forget gate saturated open, input gate closed: c_t = c_{t-1}; output gate open: h = tanh(c)
    with torch.no_grad():
        cell.weight_ih.zero_()
        cell.weight_hh.zero_()
        cell.bias_hh.zero_()
        cell.bias_ih.copy_(torch.cat([torch.full((6,), -50.0), torch.full((6,), 50.0),
                                      torch.zeros(6), torch.full((6,), 50.0)]))
    h2, c2 = cell(x, (h, c))
    assert torch.allclose(c2, c, atol=1e-6) and torch.allclose(h2, torch.tanh(c), atol=1e-6)


def test_gru_cell_matches_torch():
    torch.manual_seed(0)
    ref = nn.GRUCell(4, 6)
    cell = GRUCell(4, 6)
    copy_cell(cell, ref)
    x, h = torch.randn(3, 4), torch.randn(3, 6)
    assert torch.allclose(cell(x, h), ref(x, h), atol=ATOL)
    # update gate saturated at 1: the state is carried unchanged
    with torch.no_grad():
        cell.bias_ih[6:12] = 50.0
    assert torch.allclose(cell(x, h), h, atol=1e-6)


CONFIGS = [
    ("rnn", 1, False, "tanh"), ("rnn", 2, True, "relu"),
    ("lstm", 1, False, "tanh"), ("lstm", 2, True, "tanh"), ("lstm", 3, False, "tanh"),
    ("gru", 1, True, "tanh"), ("gru", 2, True, "tanh"),
]


@pytest.mark.parametrize("kind,layers,bidi,nl", CONFIGS)
def test_layer_fast_path_matches_reference_and_torch(kind, layers, bidi, nl):
    """Stacked + bidirectional + packed: torch module == cells from the equations; the final states
    equal those of an unpadded run of each sentence alone."""
    torch.manual_seed(0)
    m = Recurrent(kind, 5, 4, num_layers=layers, bidirectional=bidi, nonlinearity=nl).eval()
    x = torch.randn(3, 6, 5)
    lengths = torch.tensor([6, 2, 4])
    fast, fs = m(x, lengths)
    ref, rs = m.reference_forward(x, lengths)
    assert fast.shape == (3, 6, 4 * (2 if bidi else 1))
    assert torch.allclose(fast, ref, atol=ATOL)
    assert torch.allclose(fs.h, rs.h, atol=ATOL)
    if kind == "lstm":
        assert torch.allclose(fs.c, rs.c, atol=ATOL)
    else:
        assert fs.c is None
    # padding never leaks: each sentence alone (no padding) gives the same outputs and final state
    for i, n in enumerate(lengths.tolist()):
        alone, st = m(x[i : i + 1, :n])
        assert torch.allclose(fast[i : i + 1, :n], alone, atol=ATOL)
        assert (fast[i, n:] == 0).all()
        assert torch.allclose(fs.h[:, i], st.h[:, 0], atol=ATOL)


def test_unpacked_full_length_and_initial_state_match_reference():
    torch.manual_seed(0)
    m = Recurrent("lstm", 3, 4, num_layers=2, bidirectional=True).eval()
    x = torch.randn(2, 5, 3)
    init = RNNState(torch.randn(4, 2, 4), torch.randn(4, 2, 4))
    fast, fs = m(x, None, init)
    ref, rs = m.reference_forward(x, None, init)
    assert torch.allclose(fast, ref, atol=ATOL) and torch.allclose(fs.c, rs.c, atol=ATOL)
    packed, ps = m(x, torch.tensor([5, 5]), init)
    assert torch.allclose(packed, fast, atol=ATOL) and torch.allclose(ps.h, fs.h, atol=ATOL)


def test_step_by_step_equals_whole_sequence():
    """Feeding one position at a time with the carried state == one call (what decoding relies on)."""
    torch.manual_seed(0)
    for kind in ("rnn", "lstm", "gru"):
        m = Recurrent(kind, 3, 4, num_layers=2).eval()
        x = torch.randn(2, 5, 3)
        whole, _ = m(x)
        state, outs = None, []
        for t in range(5):
            o, state = m(x[:, t : t + 1], None, state)
            outs.append(o)
        assert torch.allclose(torch.cat(outs, 1), whole, atol=ATOL)


def test_dropout_between_layers_only_in_training():
    torch.manual_seed(0)
    m = Recurrent("gru", 3, 4, num_layers=2, dropout=0.5)
    x = torch.randn(2, 5, 3)
    a, _ = m(x)
    b, _ = m(x)
    assert not torch.allclose(a, b)  # training: different dropout masks between layers
    m.eval()
    assert torch.allclose(m(x)[0], m(x)[0])
    assert Recurrent("gru", 3, 4, num_layers=1, dropout=0.5).rnn.dropout == 0.0  # no layer above to drop into


def test_state_reorder_detach_and_final_states():
    h = torch.arange(24.0).view(4, 3, 2)  # 2 layers x 2 directions, B = 3, H = 2
    s = RNNState(h.requires_grad_(), h * 2)
    r = s.reorder(torch.tensor([2, 0, 0]))
    assert torch.equal(r.h[:, 0], h[:, 2]) and torch.equal(r.c[:, 1], 2 * h[:, 0])
    d = s.detach()
    assert not d.h.requires_grad and torch.equal(d.h, h)
    top = final_states(s, num_layers=2, num_directions=2)  # [h->; h<-] of layer 1
    assert top.shape == (3, 4)
    assert torch.equal(top, torch.cat([h[2], h[3]], dim=-1))
    assert RNNState(h).reorder(torch.tensor([1])).c is None


def test_bad_kind_is_rejected():
    with pytest.raises(ValueError, match="kind"):
        Recurrent("transformer", 3, 4)
    with pytest.raises(ValueError, match="nonlinearity"):
        Recurrent("rnn", 3, 4, nonlinearity="sigmoid")

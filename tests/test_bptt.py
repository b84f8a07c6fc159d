"""Truncated BPTT: windows cover the stream exactly; the gradient stops at a window boundary."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn.recurrent import Recurrent
from qkv.bptt import bptt_windows, carry, train_bptt


@pytest.mark.parametrize("length,bptt", [(11, 3), (10, 3), (7, 6), (5, 10), (2, 1)])
def test_windows_cover_the_stream_exactly(length, bptt):
    stream = torch.arange(length).repeat(2, 1) + torch.tensor([[0], [100]])  # (2, L)
    windows = list(bptt_windows(stream, bptt))
    inputs = torch.cat([w.inputs for w in windows], dim=1)
    targets = torch.cat([w.targets for w in windows], dim=1)
    assert torch.equal(inputs, stream[:, :-1])  # every position but the last is read once
    assert torch.equal(targets, stream[:, 1:])  # and its next token predicted once
    assert all(w.inputs.size(1) == bptt for w in windows[:-1])
    assert [w.start for w in windows] == list(range(0, length - 1, bptt))


def test_windows_bad_arguments():
    with pytest.raises(ValueError, match="bptt"):
        list(bptt_windows(torch.zeros(1, 5), 0))
    with pytest.raises(ValueError, match="stream"):
        list(bptt_windows(torch.zeros(5), 2))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_gradient_does_not_cross_a_truncated_boundary(kind):
    """d loss(window 2) / d input(window 1) is zero with truncation, non-zero without."""
    torch.manual_seed(0)
    rnn = Recurrent(kind, 3, 4)
    x = torch.randn(2, 8, 3, requires_grad=True)  # a continuous "stream" of inputs, 2 windows of 4
    grads = {}
    for truncate in (True, False):
        _, state = rnn(x[:, :4])  # window 1
        out2, _ = rnn(x[:, 4:], None, carry(state, truncate))  # window 2 starts from window 1's state
        (g,) = torch.autograd.grad(out2.sum(), x)
        grads[truncate] = g
    assert (grads[True][:, :4] == 0).all()
    assert grads[False][:, :4].abs().sum() > 0
    assert torch.allclose(grads[True][:, 4:], grads[False][:, 4:])  # inside the window: the same


class TinyLM(nn.Module):
    def __init__(self, vocab=12, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = Recurrent("lstm", d, d)
        self.out = nn.Linear(d, vocab)

    def forward(self, inputs, targets, state):
        h, state = self.rnn(self.embed(inputs), None, state)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten()), state


def test_train_bptt_learns_a_periodic_stream_and_clips():
    torch.manual_seed(0)
    model = TinyLM()
    stream = torch.arange(200).remainder(7).view(2, 100)  # 0 1 2 .. 6 0 1 ..: next token is predictable
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for epoch in range(8):
        losses, state = train_bptt(model, bptt_windows(stream, 10), opt, model.parameters(), clip_norm=1.0)
        first = first if first is not None else losses[0]
    assert len(losses) == 10  # 99 (input, target) pairs in windows of 10
    assert not state.h.requires_grad
    assert losses[-1] < 0.2 < first


def test_train_bptt_clips_the_gradient_norm():
    torch.manual_seed(0)
    model = TinyLM()
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
            seen.append(float(torch.norm(torch.stack(norms))))
            return super().step(closure)

    stream = torch.randint(0, 12, (2, 21))
    train_bptt(model, bptt_windows(stream, 5), Spy(model.parameters(), lr=0.0), model.parameters(), clip_norm=1e-3,
               lr=lambda: 0.0)
    assert len(seen) == 4 and all(n <= 1e-3 * (1 + 1e-4) for n in seen)

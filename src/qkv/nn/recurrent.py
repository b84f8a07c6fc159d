"""Recurrent layers: the vanilla RNN, the LSTM and the GRU, from their equations.

Each cell is written from its equations (the reference math, used by the parity tests and by
:meth:`Recurrent.reference_forward`, the slow path). :class:`Recurrent` is what models use: a
stack of layers, optionally bidirectional, with dropout between layers, over variable-length
(packed) batches, running through ``torch.nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (the fast path).
The cells read the same weights as the torch module, in torch's layout, so the two paths agree
to float tolerance (tests/test_recurrent.py).

Shapes are batch-first: inputs ``(B, T, input_size)``, outputs ``(B, T, H * directions)``.
The state is an explicit :class:`RNNState` with ``h (layers * directions, B, H)`` (and ``c``
for the LSTM), in torch's order: index ``layer * directions + direction``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from qkv.config import RNN_ARCHS
from qkv.masks import length_mask

KINDS = RNN_ARCHS  # the recurrent kinds are declared once, in qkv.config
NONLINEARITIES = ("tanh", "relu")


@dataclass
class RNNState:
    """The hidden state of a (stacked, possibly bidirectional) recurrent layer.

    ``h``: ``(layers * directions, B, H)``; ``c``: the LSTM's memory cells, same shape (None
    for the RNN and the GRU). Row ``layer * directions + direction`` as torch orders them.
    """

    h: Tensor
    c: Tensor | None = None

    def reorder(self, indices: Tensor) -> "RNNState":
        """Select/reorder batch rows (beam back-pointers, dropping finished sentences)."""
        return RNNState(self.h.index_select(1, indices), None if self.c is None else self.c.index_select(1, indices))

    def detach(self) -> "RNNState":
        """The same values cut from the graph: truncated backpropagation through time."""
        return RNNState(self.h.detach(), None if self.c is None else self.c.detach())

    def as_torch(self) -> Tensor | tuple[Tensor, Tensor]:
        """What ``nn.RNN``/``nn.GRU`` (h) or ``nn.LSTM`` ((h, c)) take as their initial state."""
        return self.h if self.c is None else (self.h, self.c)

    @staticmethod
    def from_torch(state: Tensor | tuple[Tensor, Tensor]) -> "RNNState":
        return RNNState(*state) if isinstance(state, tuple) else RNNState(state)


# --- cells: one time step, from the equations -------------------------------------------------------

class RNNCell(nn.Module):
    """The vanilla (Elman) recurrent cell:

        h_t = f(V·h_{t−1} + U·x_t + b_h),   f ∈ {tanh, ReLU}

    (the output o_t = g(W·h_t + b_o) is the model's output layer, not part of the cell).
    Weights in torch's names: U = ``weight_ih`` (H, I), V = ``weight_hh`` (H, H), and
    b_h = ``bias_ih`` + ``bias_hh`` (torch keeps two bias vectors; only their sum matters).
    """

    def __init__(self, input_size: int, hidden_size: int, nonlinearity: str = "tanh"):
        super().__init__()
        if nonlinearity not in NONLINEARITIES:
            raise ValueError(f"nonlinearity must be tanh or relu, got {nonlinearity!r}")
        self.f = torch.tanh if nonlinearity == "tanh" else torch.relu
        self.weight_ih = nn.Parameter(torch.empty(hidden_size, input_size))  # U
        self.weight_hh = nn.Parameter(torch.empty(hidden_size, hidden_size))  # V
        self.bias_ih = nn.Parameter(torch.zeros(hidden_size))
        self.bias_hh = nn.Parameter(torch.zeros(hidden_size))
        _init_uniform(self, hidden_size)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        """``x (B, I)``, ``h_{t−1} (B, H)`` -> ``h_t (B, H)``."""
        return self.f(F.linear(h, self.weight_hh, self.bias_hh) + F.linear(x, self.weight_ih, self.bias_ih))


class LSTMCell(nn.Module):
    """Long short-term memory (Hochreiter & Schmidhuber, 1997; with the forget gate of Gers et al., 2000):

        i_t = σ(W_i·x_t + U_i·h_{t−1} + b_i)        input gate
        f_t = σ(W_f·x_t + U_f·h_{t−1} + b_f)        forget gate
        o_t = σ(W_o·x_t + U_o·h_{t−1} + b_o)        output gate
        c̃_t = tanh(W_c·x_t + U_c·h_{t−1} + b_c)     candidate memory
        c_t = f_t ⊙ c_{t−1} + i_t ⊙ c̃_t
        h_t = o_t ⊙ tanh(c_t)

    The four W (and U) are stacked in ``weight_ih`` (``weight_hh``) in torch's order i, f, c̃, o.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.zeros(4 * hidden_size))
        self.bias_hh = nn.Parameter(torch.zeros(4 * hidden_size))
        _init_uniform(self, hidden_size)

    def gates(self, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The gates of one step, ``(i_t, f_t, c̃_t, o_t)`` each ``(B, H)``, from ``x (B, I)`` and ``h_{t−1} (B, H)``."""
        gates = F.linear(x, self.weight_ih, self.bias_ih) + F.linear(h, self.weight_hh, self.bias_hh)  # (B, 4H)
        i, f, c_tilde, o = gates.chunk(4, dim=-1)  # (B, H) each
        return torch.sigmoid(i), torch.sigmoid(f), torch.tanh(c_tilde), torch.sigmoid(o)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """``x (B, I)``, ``(h_{t−1}, c_{t−1})`` each ``(B, H)`` -> ``(h_t, c_t)``."""
        h, c = state
        i, f, c_tilde, o = self.gates(x, h)
        c = f * c + i * c_tilde
        return o * torch.tanh(c), c


class GRUCell(nn.Module):
    """Gated recurrent unit (Cho et al., 2014), in the form torch and cuDNN compute:

        r_t = σ(W_r·x_t + U_r·h_{t−1} + b_r)                 reset gate
        z_t = σ(W_z·x_t + U_z·h_{t−1} + b_z)                 update gate
        h̃_t = tanh(W_h·x_t + b_hx + r_t ⊙ (U_h·h_{t−1} + b_hh))  candidate state
        h_t = (1 − z_t) ⊙ h̃_t + z_t ⊙ h_{t−1}

    (Cho et al. apply the reset gate before the recurrent product, U_h·(r_t ⊙ h_{t−1}); this
    "reset after" variant is the one of torch/cuDNN, so that the fast path agrees.) Stacked in
    torch's order r, z, h̃.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.zeros(3 * hidden_size))
        self.bias_hh = nn.Parameter(torch.zeros(3 * hidden_size))
        _init_uniform(self, hidden_size)

    def gates(self, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The gates of one step, ``(r_t, z_t, h̃_t)`` each ``(B, H)``, from ``x (B, I)`` and ``h_{t−1} (B, H)``."""
        xr, xz, xh = F.linear(x, self.weight_ih, self.bias_ih).chunk(3, dim=-1)  # (B, H) each
        hr, hz, hh = F.linear(h, self.weight_hh, self.bias_hh).chunk(3, dim=-1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        return r, z, torch.tanh(xh + r * hh)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        """``x (B, I)``, ``h_{t−1} (B, H)`` -> ``h_t (B, H)``."""
        _, z, h_tilde = self.gates(x, h)
        return (1 - z) * h_tilde + z * h


def _init_uniform(module: nn.Module, hidden_size: int) -> None:
    """torch's initialisation of recurrent weights: U(−1/√H, 1/√H)."""
    bound = hidden_size**-0.5
    for p in module.parameters():
        nn.init.uniform_(p, -bound, bound)


CELLS = {"rnn": RNNCell, "lstm": LSTMCell, "gru": GRUCell}
TORCH_MODULES = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}
if tuple(CELLS) != KINDS or tuple(TORCH_MODULES) != KINDS:
    raise ImportError(f"qkv.nn.recurrent implements {tuple(CELLS)}, but qkv.config.RNN_ARCHS names {KINDS}")


# --- layers: stacked, bidirectional, packed ------------------------------------------------------------

class Recurrent(nn.Module):
    """A stack of ``num_layers`` recurrent layers of one ``kind`` (rnn | lstm | gru).

    * deep: layer l+1 reads the outputs of layer l, with dropout between layers (training only);
    * bidirectional: a forward and a backward layer read the sequence in both directions and
      their states are concatenated, h_t = [h→_t; h←_t] ``(B, T, 2H)``;
    * variable length: with ``lengths``, the batch is packed
      (``pack_padded_sequence(enforce_sorted=False)``), so padding never enters a state — the
      backward direction starts at each sentence's own last token — and outputs at padded
      positions are zeros. The final state is each sentence's state after its own last token.

    The fast path is the torch module (``self.rnn``); :meth:`reference_forward` runs the same
    weights through the cells above, one step at a time.
    """

    def __init__(self, kind: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bidirectional: bool = False, dropout: float = 0.0, nonlinearity: str = "tanh"):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if nonlinearity not in NONLINEARITIES:
            raise ValueError(f"nonlinearity must be tanh or relu, got {nonlinearity!r}")
        self.kind, self.input_size, self.hidden_size = kind, input_size, hidden_size
        self.num_layers, self.bidirectional, self.dropout = num_layers, bidirectional, dropout
        self.nonlinearity = nonlinearity
        self.num_directions = 2 if bidirectional else 1
        extra = {"nonlinearity": nonlinearity} if kind == "rnn" else {}
        self.rnn = TORCH_MODULES[kind](
            input_size, hidden_size, num_layers=num_layers, batch_first=True, bidirectional=bidirectional,
            dropout=dropout if num_layers > 1 else 0.0, **extra,
        )

    @property
    def output_size(self) -> int:
        return self.hidden_size * self.num_directions

    def initial_state(self, batch_size: int, like: Tensor) -> RNNState:
        """All-zero state ``(layers * directions, B, H)`` on ``like``'s device and dtype."""
        h = like.new_zeros(self.num_layers * self.num_directions, batch_size, self.hidden_size)
        return RNNState(h, h.clone() if self.kind == "lstm" else None)

    def forward(self, x: Tensor, lengths: Tensor | None = None, state: RNNState | None = None) -> tuple[Tensor, RNNState]:
        """``x (B, T, I)``, ``lengths (B,)`` or None (all full length), initial ``state`` or None (zeros)
        -> outputs ``(B, T, H * directions)`` (zeros at padded positions), final :class:`RNNState`."""
        hx = None if state is None else state.as_torch()
        if lengths is None:
            out, final = self.rnn(x, hx)
            return out, RNNState.from_torch(final)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, final = self.rnn(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))  # (B, T, H * dirs)
        return out, RNNState.from_torch(final)

    # --- the reference math -----------------------------------------------------------------------------

    def cell(self, layer: int, direction: int) -> nn.Module:
        """The cell of ``layer`` and ``direction`` (0 forward, 1 backward) with this module's weights (shared)."""
        cls = CELLS[self.kind]
        in_size = self.input_size if layer == 0 else self.output_size
        cell = cls(in_size, self.hidden_size, self.nonlinearity) if self.kind == "rnn" else cls(in_size, self.hidden_size)
        suffix = f"l{layer}" + ("_reverse" if direction else "")
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            setattr(cell, name, getattr(self.rnn, f"{name}_{suffix}"))
        return cell

    def reference_forward(self, x: Tensor, lengths: Tensor | None = None,
                          state: RNNState | None = None) -> tuple[Tensor, RNNState]:
        """The same computation as :meth:`forward`, one cell step at a time (slow; no dropout).

        A sentence of length n updates its state at positions 0..n−1 only: forward cells run
        t = 0..T−1, backward cells t = T−1..0, and a padded position leaves the state unchanged,
        so the backward direction starts from the initial state at the sentence's last token.
        """
        b, t_len, _ = x.shape
        lengths = torch.full((b,), t_len, dtype=torch.long, device=x.device) if lengths is None else lengths.to(x.device)
        valid = length_mask(lengths, t_len)  # (B, T)
        state = state or self.initial_state(b, x)
        h_final, c_final = [], []
        inp = x
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                cell, k = self.cell(layer, d), layer * self.num_directions + d
                h = state.h[k]
                c = None if state.c is None else state.c[k]
                out = x.new_zeros(b, t_len, self.hidden_size)
                for t in (range(t_len) if d == 0 else reversed(range(t_len))):
                    m = valid[:, t, None]  # (B, 1)
                    if self.kind == "lstm":
                        h_new, c_new = cell(inp[:, t], (h, c))
                        c = torch.where(m, c_new, c)
                    else:
                        h_new = cell(inp[:, t], h)
                    h = torch.where(m, h_new, h)
                    out[:, t] = torch.where(m, h, torch.zeros_like(h))
                outs.append(out)
                h_final.append(h)
                c_final.append(c)
            inp = torch.cat(outs, dim=-1)  # (B, T, H * dirs)
        c_stack = torch.stack(c_final) if self.kind == "lstm" else None
        return inp, RNNState(torch.stack(h_final), c_stack)


def final_states(state: RNNState, num_layers: int, num_directions: int, layer: int = -1) -> Tensor:
    """The final hidden state of one layer (default: the top), directions concatenated:
    ``[h→_n; h←_1]`` ``(B, H * directions)`` — the context vector of an encoder."""
    h = state.h.view(num_layers, num_directions, *state.h.shape[1:])[layer]  # (dirs, B, H)
    return torch.cat(list(h), dim=-1)  # (B, H * dirs)


__all__ = ["RNNState", "RNNCell", "LSTMCell", "GRUCell", "Recurrent", "final_states", "KINDS", "NONLINEARITIES"]

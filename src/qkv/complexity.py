"""Table 1 of the paper, measured: the cost of one layer of each type as the sequence grows.

Section 4 ("Why Self-Attention") compares layer types by three numbers; Table 1 gives them for
sequence length n, representation dimension d, kernel width k and neighbourhood radius r:

    layer type                     complexity per layer   sequential operations   maximum path length
    self-attention                 O(n²·d)                O(1)                    O(1)
    recurrent                      O(n·d²)                O(n)                    O(n)
    convolutional                  O(k·n·d²)              O(1)                    O(n/k), O(log_k n) dilated
    self-attention (restricted)    O(r·n·d)               O(1)                    O(n/r)

"self-attention layers are faster than recurrent layers when the sequence length n is smaller
than the representation dimensionality d". Here each layer (``LAYERS``) runs forward and backward
at growing n, and each column is measured, not assumed:

* **FLOPs** — counted by :class:`torch.utils.flop_counter.FlopCounterMode` (2 per multiply-add of
  every matmul, convolution and attention kernel, forward and backward separately). Two gaps of the
  counter on CPU are closed here: torch's CPU flash-attention kernel
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) gets torch's own SDPA formula,
  and ``nn.LSTM`` is counted with oneDNN off, where torch runs it as per-step ``addmm``/``mm`` the
  counter sees (the fused oneDNN ``mkldnn_rnn_layer`` is invisible to it). The same settings apply
  to every layer: conv and attention count the same either way.
* **wall time** — forward + backward, median of ``repeats`` runs after one warm-up, default
  settings (oneDNN LSTM: torch's fast path).
* **peak memory** — :class:`PeakMemory`, a ``TorchDispatchMode`` that sees every tensor an operator
  returns (forward and backward), counts each new storage's bytes while it is alive (a
  ``weakref.finalize`` on the storage subtracts them when it is freed) and keeps the maximum: the
  peak of live tensor bytes allocated by the layer's forward + backward beyond its inputs and
  weights (activations, saved tensors, gradients). ``tracemalloc`` cannot see torch's allocator, and
  process RSS mixes in the allocator's caching; scratch space inside one kernel is not counted.
* **sequential steps** — :class:`DependentSteps`, a ``TorchDispatchMode`` that gives each tensor a
  depth, 1 + the largest depth of the inputs of the operator that made it (views add nothing): the
  longest chain of dependent kernel launches of the forward pass, its critical path. A recurrent
  layer's chain grows with n (step t needs h_{t-1}); the others' is a constant.
* **maximum path length** — :func:`path_length`, from gradients: the fewest stacked layers L such
  that ∂y_n/∂x_1 ≠ 0 (output position n depends on input position 1). It depends on the
  connectivity, not on d, so it is probed at small d (``PROBE_D``) in float64. For recurrence the
  unit is the recurrent step: the fewest steps s such that a recurrence that carries its state at
  most s steps (run on x_{n-s..n}) still has ∂y_n/∂x_1 ≠ 0.

Exponents are fitted by least squares of log(measure) on log(n) over the upper range of n
(:func:`fit_exponent`). A term that Table 1 leaves out shows up in them: multi-head attention
also projects Q, K, V and the output, 8·n·d² forward FLOPs beside eq. 1's 4·n²·d, so its fitted
FLOP exponent lies between 1 and 2 until n ≫ 2d (the row ``attention-core`` is eq. 1 alone).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakTensorKeyDictionary

from qkv.errors import QkvError
from qkv.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from qkv.nn.recurrent import Recurrent
from qkv.nn.restricted_attention import RestrictedSelfAttention

PROBE_D = 4  # width of the path-length probes: connectivity does not depend on d


# --- the layer zoo: x (B, n, d) -> (B, n, d) -----------------------------------------------------------

class SelfAttention(nn.Module):
    """One multi-head self-attention layer (:class:`MultiHeadAttention`): forward FLOPs
    8·n·d² (Q, K, V and output projections) + 4·n²·d (QKᵀ and AV, eq. 1)."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.attn = MultiHeadAttention(d, n_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.self_attention(x)[0]


class AttentionCore(nn.Module):
    """Eq. 1 alone, softmax(QKᵀ/√d_k)V over h heads with Q = K = V = x: forward FLOPs 4·n²·d,
    the O(n²·d) term of Table 1 without the projections."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q = x.view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2)  # (B, h, n, d_k)
        out, _ = scaled_dot_product_attention(q, q, q)
        return out.transpose(1, 2).reshape(b, n, d)  # (B, n, d)


class RecurrentLayer(nn.Module):
    """One recurrent layer (:class:`qkv.nn.recurrent.Recurrent`: torch's ``nn.LSTM``, forward FLOPs
    16·n·d², four gates, each W x_t + U h_{t-1}; or ``nn.RNN`` with tanh, 4·n·d²); n dependent steps."""

    def __init__(self, d: int, cell: str):
        super().__init__()
        self.rnn = Recurrent(cell, d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]  # (B, n, d)


class CausalConv(nn.Module):
    """1-D convolution of width k over positions, d channels in and out (forward FLOPs 2·k·n·d²),
    padded on the left by (k-1)·dilation so that output t reads inputs t, t-δ, ..., t-(k-1)δ and
    the length is kept (as ByteNet and WaveNet)."""

    def __init__(self, d: int, k: int, dilation: int = 1):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv = nn.Conv1d(d, d, k, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x.transpose(1, 2), (self.pad, 0))  # (B, d, pad + n)
        return self.conv(h).transpose(1, 2)  # (B, n, d)


@dataclass(frozen=True)
class LayerType:
    """One row of the table: what it is and what Table 1 says of it."""

    name: str
    description: str
    complexity: str  # Table 1's complexity per layer
    sequential: str  # Table 1's sequential operations
    path: str  # Table 1's maximum path length
    exponents: tuple[float, float, float]  # the growth exponents in n Table 1 implies: FLOPs, steps, path


LAYERS: dict[str, LayerType] = {t.name: t for t in [
    LayerType("self-attention", "MultiHeadAttention, h heads (with W^Q,K,V,O)", "O(n²·d)", "O(1)", "O(1)", (2, 0, 0)),
    LayerType("attention-core", "eq. 1 only, softmax(QKᵀ/√d_k)V, h heads", "O(n²·d)", "O(1)", "O(1)", (2, 0, 0)),
    LayerType("restricted", "window ±r, blocked: 3r keys per query", "O(r·n·d)", "O(1)", "O(n/r)", (1, 0, 1)),
    LayerType("restricted-dense", "window ±r as a band mask on full attention", "O(r·n·d)", "O(1)", "O(n/r)", (1, 0, 1)),
    LayerType("lstm", "nn.LSTM", "O(n·d²)", "O(n)", "O(n)", (1, 1, 1)),
    LayerType("rnn", "nn.RNN (tanh)", "O(n·d²)", "O(n)", "O(n)", (1, 1, 1)),
    LayerType("conv", "causal Conv1d, kernel k", "O(k·n·d²)", "O(1)", "O(n/k)", (1, 0, 1)),
    LayerType("conv-dilated", "causal Conv1d, kernel k, dilation k^i in layer i", "O(k·n·d²)", "O(1)", "O(log_k n)",
              (1, 0, 0)),
]}


def make_layer(kind: str, d: int, n_heads: int = 8, r: int = 64, k: int = 3, layer_index: int = 1) -> nn.Module:
    """One layer of type ``kind`` (a key of ``LAYERS``), ``(B, n, d) -> (B, n, d)``.

    ``layer_index`` i sets the dilation k^i of ``conv-dilated`` (the cost sweep uses i = 1: every
    layer of a dilated stack costs the same).
    """
    if kind == "self-attention":
        return SelfAttention(d, n_heads)
    if kind == "attention-core":
        return AttentionCore(d, n_heads)
    if kind in ("restricted", "restricted-dense"):
        # blocked: 8·n·d² + 12·r·n·d forward FLOPs; dense (band mask on full attention): still 8·n·d² + 4·n²·d
        return RestrictedSelfAttention(d, n_heads, r, dense=kind == "restricted-dense")
    if kind in ("lstm", "rnn"):
        return RecurrentLayer(d, kind)
    if kind == "conv":
        return CausalConv(d, k)
    if kind == "conv-dilated":
        return CausalConv(d, k, dilation=k**layer_index)
    raise ValueError(f"unknown layer type {kind!r}; choose from {', '.join(LAYERS)}")


# --- measuring one layer ---------------------------------------------------------------------------------

def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_aten = torch.ops.aten
CPU_SDPA_FLOPS = {  # torch's counter knows the CUDA attention kernels, not the CPU one
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}


def _input(n: int, d: int, batch: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, n, d, dtype=dtype, requires_grad=True)


def _forward_backward(layer: nn.Module, x: torch.Tensor) -> None:
    y = layer(x)
    y.backward(torch.ones_like(y))


def count_flops(layer: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of one pass, counted by FlopCounterMode (oneDNN off)."""
    with torch.backends.mkldnn.flags(enabled=False):
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as fwd:
            y = layer(x)
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as bwd:
            y.backward(torch.ones_like(y))
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return fwd.get_total_flops(), bwd.get_total_flops()


class DependentSteps(TorchDispatchMode):
    """The critical path of the operators run under it: each tensor's depth is 1 + the largest depth
    among the inputs of the operator that produced it (0 for tensors made outside; a view keeps
    the depth of its base). ``depth_of(t)`` reads it; ``max_depth`` is the longest chain seen."""

    def __init__(self):
        super().__init__()
        self.depth = WeakTensorKeyDictionary()
        self.max_depth = 0

    def depth_of(self, t: torch.Tensor) -> int:
        return self.depth.get(t, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        d = max((self.depth.get(a, 0) for a in inputs), default=0) + (0 if func.is_view else 1)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.depth[t] = d
        self.max_depth = max(self.max_depth, d)
        return out


def sequential_steps(layer: nn.Module, x: torch.Tensor) -> int:
    """Dependent operator launches on the forward pass from x to the output (oneDNN off, so that
    torch's LSTM runs step by step as operators this can see)."""
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        with DependentSteps() as mode:
            y = layer(x)
            return mode.depth_of(y)


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once among the storages the operators under it
    created. Outputs that share storage with an input (views, in-place results) are not new."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # data_ptr -> bytes
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in seen or key in self.live:
                continue
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


def peak_memory(layer: nn.Module, x: torch.Tensor) -> int:
    """Peak live bytes allocated by one forward + backward (see :class:`PeakMemory`)."""
    with PeakMemory() as mode:
        _forward_backward(layer, x)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return mode.peak


def wall_time(layer: nn.Module, x: torch.Tensor, repeats: int = 3) -> float:
    """Median seconds of forward + backward over ``repeats`` runs, after one warm-up run."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        _forward_backward(layer, x)
        if i:
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return statistics.median(times)


# --- maximum path length, from gradients -----------------------------------------------------------------

def _probe_init(module: nn.Module) -> None:
    """Weights for the connectivity probes: every weight positive (no two paths can cancel), each
    output row an average of its inputs (values neither blow up nor vanish over thousands of
    layers); biases 0. The LSTM keeps its cell open (forget gate ≈ 1) and nearly shut to input
    (input gate ≈ 5·10⁻⁵) so that its state stays small over 4,096 steps."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name:
                p.zero_()
                if isinstance(module, nn.LSTM) or any(isinstance(m, nn.LSTM) for m in module.modules()):
                    h = p.numel() // 4
                    if "bias_ih" in name:
                        p[:h] = -10.0  # input gate (torch's gate order: i, f, g, o)
                        p[h : 2 * h] = 20.0  # forget gate
                continue
            p.uniform_(0.5, 1.0)
            flat = p.view(p.size(0), -1)
            flat /= flat.sum(dim=1, keepdim=True)


def _keep_direction(grad: torch.Tensor) -> torch.Tensor:
    """Backward hook: rescale each position's gradient vector by its largest entry. Which entries
    are zero is unchanged, and a gradient carried through thousands of layers cannot underflow."""
    scale = grad.abs().amax(dim=-1, keepdim=True)  # (B, n, 1)
    return grad / torch.where(scale > 0, scale, torch.ones_like(scale))


def _stack_reach(kind: str, n: int, n_layers: int, r: int, k: int, d: int) -> int | None:
    """Stack ``n_layers`` layers, backpropagate from output position n, and return the fewest top
    layers ℓ whose input at position 1 has a non-zero gradient (None: not even all of them).

    One backward pass answers every ℓ: the gradient at the input of layer L-ℓ is ∂y_n/∂h^{(L-ℓ)},
    i.e. that of a stack of ℓ layers. For ``conv-dilated`` the dilations run from k^{L-1} at the
    bottom to k^0 at the top, so that the top ℓ layers are a dilated stack 1, k, ..., k^{ℓ-1}.
    """
    torch.manual_seed(0)
    layers = [make_layer(kind, d, n_heads=1, r=r, k=k, layer_index=n_layers - 1 - i).double() for i in range(n_layers)]
    for layer in layers:
        _probe_init(layer)
    h = torch.rand(1, n, d, dtype=torch.float64) * 0.1
    inputs = []
    for layer in layers:
        h = h.detach().requires_grad_() if not inputs else h
        h.retain_grad()
        h.register_hook(_keep_direction)
        inputs.append(h)
        h = layer(h)
    h[:, n - 1].sum().backward()
    for depth in range(1, n_layers + 1):
        g = inputs[n_layers - depth].grad
        if g is not None and g[:, 0].abs().max() > 0:
            return depth
    return None


def _recurrent_reach(kind: str, n: int, steps: int, d: int) -> bool:
    """Does y_n depend on x_1 when the state is carried at most ``steps`` recurrent steps, i.e.
    when y_n is computed by the recurrence over x_{n-steps}, ..., x_n only?"""
    torch.manual_seed(0)
    layer = make_layer(kind, d).double()
    _probe_init(layer)
    x = (torch.rand(1, n, d, dtype=torch.float64) * 0.1).requires_grad_()
    start = max(0, n - 1 - steps)
    y = layer(x[:, start:])
    y[:, -1].sum().backward()
    return bool(x.grad[:, 0].abs().max() > 0)


def path_length(kind: str, n: int, r: int = 64, k: int = 3, d: int = PROBE_D, max_layers: int = 1 << 16,
                start: int = 1) -> int:
    """The fewest layers (recurrent steps, for ``lstm``/``rnn``) after which output position n
    depends on input position 1, found from gradients (see the module docstring). For stacks the
    number of layers doubles until position 1 is reached; for recurrences a binary search on the
    steps. Expected: 1 (attention), ⌈(n-1)/r⌉ (restricted), n-1 (recurrent), ⌈(n-1)/(k-1)⌉ (conv),
    ⌈log_k n⌉ (dilated conv). ``start``: the first stack height tried (any value is safe, since one
    pass with L layers answers every ℓ <= L; the sweep passes the answer at the previous n)."""
    if n < 2:
        return 0
    if kind in ("lstm", "rnn"):
        lo, hi = 0, 1
        while not _recurrent_reach(kind, n, hi, d):
            lo, hi = hi, hi * 2
            if hi > 2 * n:
                raise RuntimeError(f"{kind}: y_n never depends on x_1 at n={n}")
        while hi - lo > 1:  # reach(lo) is False, reach(hi) is True
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _recurrent_reach(kind, n, mid, d) else (mid, hi)
        return hi
    n_layers = max(1, start)
    while True:
        found = _stack_reach(kind, n, n_layers, r, k, d)
        if found is not None:
            return found
        n_layers *= 2
        if n_layers > max_layers:
            raise RuntimeError(f"{kind}: position 1 not reached from position {n} within {max_layers} layers")


def expected_path_length(kind: str, n: int, r: int, k: int) -> int:
    """What the connectivity implies (the exact forms behind Table 1's last column)."""
    if n < 2:
        return 0
    if kind in ("self-attention", "attention-core"):
        return 1
    if kind in ("restricted", "restricted-dense"):
        return math.ceil((n - 1) / r)
    if kind in ("lstm", "rnn"):
        return n - 1
    if kind == "conv":
        return math.ceil((n - 1) / (k - 1))
    if kind == "conv-dilated":
        layers = 0
        while k**layers < n:  # the receptive field of L dilated layers is k^L positions
            layers += 1
        return layers
    raise ValueError(kind)


# --- fits, crossover -------------------------------------------------------------------------------------

def fit_exponent(ns: list[int], ys: list[float], n_from: int = 0) -> float | None:
    """Least-squares slope of log y on log n over the points with n >= n_from and y > 0."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if n >= n_from and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def crossover(ns: list[int], a: list[float], b: list[float]) -> float | None:
    """The first n at which ``a`` overtakes ``b`` (from a <= b to a > b), interpolated linearly in
    log n between the grid points around it; None if it never does in the range."""
    for i in range(1, len(ns)):
        if a[i - 1] <= b[i - 1] and a[i] > b[i]:
            f0 = math.log(a[i - 1] / b[i - 1])  # <= 0
            f1 = math.log(a[i] / b[i])  # > 0
            w = -f0 / (f1 - f0)
            return math.exp(math.log(ns[i - 1]) + w * (math.log(ns[i]) - math.log(ns[i - 1])))
    return None


# --- the sweep -------------------------------------------------------------------------------------------

def check_settings(d: int, n_heads: int, r: int, k: int, kinds: list[str]) -> None:
    if d < 1 or n_heads < 1 or d % n_heads:
        raise ValueError(f"d = {d} must be a positive multiple of the number of heads {n_heads}")
    if k < 2 or r < 1:
        raise ValueError(f"need k >= 2 and r >= 1 (got k={k}, r={r})")
    for kind in kinds:
        if kind not in LAYERS:
            raise ValueError(f"unknown layer type {kind!r}; choose from {', '.join(LAYERS)}")


@dataclass
class Point:
    """One layer type at one n."""

    n: int
    flops_forward: int
    flops_backward: int
    seconds: float
    peak_bytes: int
    sequential_steps: int
    path_length: int
    path_length_expected: int


def powers_of_two(n_min: int, n_max: int) -> list[int]:
    ns, n = [], n_min
    while n <= n_max:
        ns.append(n)
        n *= 2
    if ns[-1] != n_max:
        ns.append(n_max)
    return ns


def run_metadata() -> dict:
    """When, where and at which commit a measurement ran (the commit when run from a git checkout)."""
    import datetime
    import subprocess
    from pathlib import Path

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def measure_layers(
    d: int = 512,
    ns: list[int] | None = None,
    r: int = 64,
    k: int = 3,
    n_heads: int = 8,
    batch: int = 1,
    repeats: int = 3,
    kinds: list[str] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Run the sweep: every layer type at every n; returns a JSON-able dict (``report`` reads it)."""
    ns = ns or powers_of_two(16, 4096)
    kinds = kinds or list(LAYERS)
    check_settings(d, n_heads, r, k, kinds)
    results: dict[str, list[dict]] = {}
    meta = run_metadata()
    t_start = time.perf_counter()
    for kind in kinds:
        torch.manual_seed(0)
        layer = make_layer(kind, d, n_heads, r, k)
        points = []
        for n in ns:
            x = _input(n, d, batch)
            fwd, bwd = count_flops(layer, x)
            steps = sequential_steps(layer, x)
            mem = peak_memory(layer, x)
            sec = wall_time(layer, x, repeats)
            path = path_length(kind, n, r, k, start=points[-1]["path_length"] if points else 1)
            p = Point(n, fwd, bwd, sec, mem, steps, path, expected_path_length(kind, n, r, k))
            points.append(asdict(p))
            log(f"[{time.perf_counter() - t_start:7.1f}s] {kind:<17} n={n:<5} FLOPs {fwd + bwd:10.3e}  "
                f"time {sec * 1e3:9.2f} ms  peak {mem / 2**20:8.2f} MiB  steps {steps:6d}  path {path}")
        results[kind] = points
    return {
        "settings": {"d": d, "ns": ns, "r": r, "k": k, "n_heads": n_heads, "batch": batch, "repeats": repeats,
                     "probe_d": PROBE_D, "threads": torch.get_num_threads()},
        "machine": meta,
        "layers": results,
        "seconds": time.perf_counter() - t_start,
    }


MEASURES = [  # (key in a point, label)
    ("flops", "FLOPs"),
    ("seconds", "time"),
    ("peak_bytes", "memory"),
    ("sequential_steps", "seq. steps"),
    ("path_length", "path length"),
]


def _series(points: list[dict], key: str) -> list[float]:
    if key == "flops":
        return [p["flops_forward"] + p["flops_backward"] for p in points]
    return [p[key] for p in points]


def summarize(result: dict, fit_from: int | None = None) -> dict:
    """Exponents per layer type and measure, the path-length check, and the crossovers."""
    ns = result["settings"]["ns"]
    d = result["settings"]["d"]
    fit_from = fit_from or max(ns[0], ns[-1] // 8)
    rows = {}
    for kind, points in result["layers"].items():
        pn = [p["n"] for p in points]
        rows[kind] = {key: fit_exponent(pn, _series(points, key), fit_from) for key, _ in MEASURES}
        rows[kind]["flops_forward"] = fit_exponent(pn, [p["flops_forward"] for p in points], fit_from)
        rows[kind]["path_matches"] = all(p["path_length"] == p["path_length_expected"] for p in points)
    cross = {}
    layers = result["layers"]
    for att in ("self-attention", "attention-core"):
        for rec in ("lstm", "rnn"):
            if att in layers and rec in layers:
                for which in ("flops_forward", "flops"):
                    a = _series(layers[att], which) if which == "flops" else [p[which] for p in layers[att]]
                    b = _series(layers[rec], which) if which == "flops" else [p[which] for p in layers[rec]]
                    cross[f"{att} > {rec} ({'forward' if which == 'flops_forward' else 'forward+backward'} FLOPs)"] = \
                        crossover(ns, a, b)
                cross[f"{att} > {rec} (time)"] = crossover(
                    ns, _series(layers[att], "seconds"), _series(layers[rec], "seconds"))
    return {"fit_from": fit_from, "fit_to": ns[-1], "d": d, "exponents": rows, "crossovers": cross}


def format_report(result: dict, summary: dict) -> str:
    """The exponent table beside Table 1, the path-length check, and the crossovers, as Markdown."""
    s = result["settings"]
    lines = [f"Growth exponents in n (least squares on log-log, n = {summary['fit_from']}..{summary['fit_to']}; "
             f"d = {s['d']}, h = {s['n_heads']}, r = {s['r']}, k = {s['k']}, batch {s['batch']}; "
             f"FLOPs, time, memory: forward + backward)", "",
             "| layer type | FLOPs | time | memory | seq. steps | path length | path = formula at every n "
             "| Table 1: complexity | sequential | path |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]

    def f(v):
        return "–" if v is None else f"{v:.2f}"

    for kind, row in summary["exponents"].items():
        t = LAYERS[kind]
        lines.append(f"| {kind} ({t.description}) | {f(row['flops'])} | {f(row['seconds'])} | "
                     f"{f(row['peak_bytes'])} | {f(row['sequential_steps'])} | {f(row['path_length'])} | "
                     f"{'yes' if row['path_matches'] else '**no**'} | {t.complexity} | {t.sequential} | {t.path} |")
    lines += ["", f"Crossovers (n at which the first costs more than the second; the paper: n ≈ d = {s['d']}):", ""]
    for name, v in summary["crossovers"].items():
        lines.append(f"- {name}: " + ("not in the measured range" if v is None else f"n ≈ {v:.0f} (n/d = {v / s['d']:.2f})"))
    lines += ["", "Measured values (forward + backward):", "",
              "| layer type | n | FLOPs | time (ms) | peak memory (MiB) | seq. steps | path length |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, points in result["layers"].items():
        for p in points:
            lines.append(f"| {kind} | {p['n']} | {p['flops_forward'] + p['flops_backward']:.3e} | "
                         f"{p['seconds'] * 1e3:.2f} | {p['peak_bytes'] / 2**20:.2f} | {p['sequential_steps']} | "
                         f"{p['path_length']} |")
    return "\n".join(lines)


def new_figure(**kwargs):
    """A matplotlib Figure on an Agg canvas (no pyplot state, no display); a clear error without
    matplotlib, which the benches check before they start measuring."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise QkvError("drawing the plots needs matplotlib: pip install 'qkv[viz]'") from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def plot(result: dict, path: str) -> str:
    """Log-log panels of each measure against n, one line per layer type."""
    fig = new_figure(figsize=(13, 8))
    grid = fig.subplots(2, 3)
    axes = grid.flat
    s = result["settings"]
    for ax, (key, label) in zip(axes, MEASURES):
        for kind, points in result["layers"].items():
            ns = [p["n"] for p in points]
            ys = _series(points, key)
            if key == "peak_bytes":
                ys = [y / 2**20 for y in ys]
            elif key == "seconds":
                ys = [y * 1e3 for y in ys]
            ax.plot(ns, [max(y, 1e-12) for y in ys], marker="o", ms=3, label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_title({"seconds": "wall time (ms)", "peak_bytes": "peak tensor memory (MiB)",
                      "sequential_steps": "sequential steps (dependent ops, forward)",
                      "path_length": "max path length (layers / steps)"}.get(key, label + " (counted)"))
        ax.grid(True, which="both", alpha=0.3)
        if key in ("flops", "seconds"):
            ax.axvline(s["d"], color="grey", ls="--", lw=0.8)
    handles, labels = grid[0, 0].get_legend_handles_labels()
    grid[1, 2].axis("off")
    grid[1, 2].legend(handles, labels, loc="center", title="layer type")
    fig.suptitle(f"One layer, forward + backward, d = {s['d']}, r = {s['r']}, k = {s['k']} (dashed: n = d)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_json(obj: dict, path: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
    return path


def bench_layers(out_dir: str, d: int = 512, n_min: int = 16, n_max: int = 4096, r: int = 64, k: int = 3,
                 n_heads: int = 8, batch: int = 1, repeats: int = 3, kinds: list[str] | None = None,
                 log: Callable[[str], None] = lambda s: None) -> tuple[str, list[str]]:
    """The whole of ``qkv bench layers``: sweep, fit, write ``complexity.json`` (measurements,
    exponents, crossovers), ``complexity.md`` (the tables) and ``complexity.png`` (log-log plot)
    into ``out_dir``. Returns the report text and the files written."""
    from pathlib import Path

    if n_min < 2 or n_max < n_min:
        raise ValueError(f"need 2 <= n_min <= n_max (got {n_min}, {n_max})")
    check_settings(d, n_heads, r, k, kinds or list(LAYERS))
    new_figure()  # matplotlib is there, before minutes of measuring
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = measure_layers(d, powers_of_two(n_min, n_max), r, k, n_heads, batch, repeats, kinds, log)
    summary = summarize(result)
    text = format_report(result, summary)
    written = [write_json({**result, "summary": summary}, str(out / "complexity.json"))]
    (out / "complexity.md").write_text(text + "\n", encoding="utf-8")
    written += [str(out / "complexity.md"), plot(result, str(out / "complexity.png"))]
    return text, written

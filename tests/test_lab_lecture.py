"""The lab's look-inside pieces (qkv.lab.lecture) against computations written here: a Transformer's
attention stage by stage in plain torch from the checkpoint's weights, the next-token probabilities
against the model's own forward, the model view against the same plain-torch recomputation, an
LSTM's and a GRU's gates from torch's documented equations and torch.nn.LSTMCell / GRUCell, the
gradient reaching each input against a hand-solved linear recurrence and finite differences."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.frontends import load
from qkv.lab import lecture
from qkv.lab.lecture import LectureError

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
TEXT = "red cat"


@pytest.fixture(scope="module")
def transformer():
    return load(FIXTURES / "translate-transformer")


@pytest.fixture(scope="module")
def lstm():
    return load(FIXTURES / "translate-lstm-general")


def t(x) -> torch.Tensor:
    """A list answer (None: masked, -inf) as a float64 tensor."""
    return torch.tensor([[-math.inf if v is None else v for v in row] for row in x], dtype=torch.float64)


# --- plain torch: the paper's equations on the checkpoint's weights ---------------------------------------

def pe(n: int, d: int) -> torch.Tensor:
    out = torch.zeros(n, d)
    for pos in range(n):
        for i in range(0, d, 2):
            out[pos, i] = math.sin(pos / 10000 ** (i / d))
            out[pos, i + 1] = math.cos(pos / 10000 ** (i / d))
    return out


def heads(mha, xq, xk, mask):
    """Multi-head attention of ``xq (Tq, d)`` over ``xk (Tk, d)`` in plain torch: per head (q, k, v,
    weights), and the output Concat(heads) W^O + b."""
    d, h = mha.d_model, mha.n_heads
    dk = d // h
    W, b = mha.in_proj.weight, mha.in_proj.bias
    Q, K, V = xq @ W[:d].T + b[:d], xk @ W[d:2 * d].T + b[d:2 * d], xk @ W[2 * d:].T + b[2 * d:]
    per, outs = [], []
    for i in range(h):
        c = slice(i * dk, (i + 1) * dk)
        s = (Q[:, c] @ K[:, c].T) / math.sqrt(dk)
        w = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
        per.append((Q[:, c], K[:, c], V[:, c], w))
        outs.append(w @ V[:, c])
    return per, torch.cat(outs, -1) @ mha.out_proj.weight.T + mha.out_proj.bias


def ln(norm, x):
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def ffn(f, x):
    return torch.relu(x @ f.w_1.weight.T + f.w_1.bias) @ f.w_2.weight.T + f.w_2.bias


def sublayer(res, x, fn):
    """Post-norm LN(x + f(x)) or pre-norm x + f(LN(x)); returns (new x, what f read, f's extra)."""
    inp = ln(res.norm, x) if res.norm_first else x
    y, extra = fn(inp)
    return (x + y if res.norm_first else ln(res.norm, x + y)), inp, extra


def plain(model, src_ids, tgt_ids):
    """Every attention kind, layer and head of a Transformer encoder-decoder in plain torch:
    {kind: [layer] -> (what the sublayer's queries read, what its keys read, per-head list)},
    the encoder's output, and the next-token logits."""
    d = model.cfg.d_model
    E = model.src_embed.weight
    S, T = len(src_ids), len(tgt_ids)
    x = E[src_ids] * math.sqrt(d) + pe(S, d)
    out = {"encoder": [], "decoder_self": [], "cross": [], "x0": x}
    full = torch.ones(S, S, dtype=torch.bool)
    for lay in model.encoder_layers:
        def att(inp, lay=lay):
            per, o = heads(lay.self_attn, inp, inp, full)
            return o, per
        x, inp, per = sublayer(lay.res_attn, x, att)
        out["encoder"].append((inp, inp, per))
        x, _, _ = sublayer(lay.res_ffn, x, lambda i, lay=lay: (ffn(lay.ffn, i), None))
    memory = ln(model.encoder_norm, x) if model.cfg.norm_first else x
    y = model.tgt_embed.weight[tgt_ids] * math.sqrt(d) + pe(T, d)
    out["y0"] = y
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for lay in model.decoder_layers:
        def self_att(inp, lay=lay):
            per, o = heads(lay.self_attn, inp, inp, causal)
            return o, per
        y, inp, per = sublayer(lay.res_self, y, self_att)
        out["decoder_self"].append((inp, inp, per))

        def cross(inp, lay=lay):
            per, o = heads(lay.cross_attn, inp, memory, torch.ones(T, S, dtype=torch.bool))
            return o, per
        y, inp, per = sublayer(lay.res_cross, y, cross)
        out["cross"].append((inp, memory, per))
        y, _, _ = sublayer(lay.res_ffn, y, lambda i, lay=lay: (ffn(lay.ffn, i), None))
    if model.cfg.norm_first:
        y = ln(model.decoder_norm, y)
    out["memory"], out["logits"] = memory, y @ model.tgt_embed.weight.T
    return out


def ids(translator, text, target):
    src = translator.tokenizers.src.encode([text])[0] + [3]  # pieces + EOS
    tgt = [2] + translator.tokenizers.tgt.encode([target])[0]  # BOS + pieces
    return src, tgt


# --- 1. one attention computation step by step -------------------------------------------------------------

def prenorm(translator):
    """The fixture's tokenizers over a pre-norm Transformer of the same shape (seeded weights)."""
    from qkv.frontends.translator import Translator
    from qkv.models.transformer import Transformer

    torch.manual_seed(3)
    model = Transformer(replace(translator.model.cfg, norm_first=True)).eval()
    return Translator(model, translator.tokenizers, translator.decode_cfg)


@pytest.mark.parametrize("which", ["post-norm", "pre-norm"])
@pytest.mark.parametrize("kind, layer, head", [("encoder", 0, 0), ("encoder", 1, 1), ("decoder_self", 1, 0),
                                               ("cross", 0, 1), ("cross", 1, 0)])
def test_each_stage_is_the_plain_torch_one(transformer, which, kind, layer, head):
    tr = transformer if which == "post-norm" else prenorm(transformer)
    target = "blue cat"
    s = lecture.attention_steps(tr, TEXT, kind=kind, layer=layer, head=head, target=target)
    src, tgt = ids(tr, TEXT, target)
    with torch.no_grad():
        ref = plain(tr.model, src, tgt)
    d, dk = tr.model.cfg.d_model, tr.model.cfg.d_model // tr.model.cfg.n_heads
    tol = dict(atol=2e-4, rtol=1e-3)
    side_ids = src if kind == "encoder" else tgt
    embed = tr.model.src_embed.weight[side_ids] * math.sqrt(d)
    torch.testing.assert_close(t(s["embedding"]), embed.double(), **tol)
    torch.testing.assert_close(t(s["positions"]), pe(len(side_ids), d).double(), **tol)
    torch.testing.assert_close(t(s["x0"]), (ref["x0"] if kind == "encoder" else ref["y0"]).double(), **tol)
    q_in, k_in, per = ref[kind][layer]
    q, k, v, w = per[head]
    torch.testing.assert_close(t(s["query_input"]), q_in.double(), **tol)
    torch.testing.assert_close(t(s["key_input"]), k_in.double(), **tol)
    for name, want in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(t(s[name]), want.double(), **tol)
    torch.testing.assert_close(t(s["scores"]), (q @ k.T).double(), **tol)
    torch.testing.assert_close(t(s["scaled"]), (q @ k.T / math.sqrt(dk)).double(), **tol)
    assert s["scale"] == pytest.approx(math.sqrt(dk))
    n_q, n_k = len(q), len(k)
    want_mask = [[j <= i for j in range(n_k)] for i in range(n_q)] if kind == "decoder_self" else \
        [[True] * n_k for _ in range(n_q)]
    assert s["mask"] == want_mask
    assert all((v is None) == (not m) for row, mrow in zip(s["masked"], s["mask"]) for v, m in zip(row, mrow))
    torch.testing.assert_close(t(s["weights"]), w.double(), **tol)
    torch.testing.assert_close(t(s["output"]), (w @ v).double(), **tol)
    assert s["tokens"]["target"] == [tr.tokenizers.tgt.id_to_piece(i) for i in tgt]


def test_the_weights_are_the_models_own(transformer):
    """The step-by-step weights are what the model's forward pass returns (attention_maps)."""
    s = lecture.attention_steps(transformer, TEXT, kind="cross", layer=1, head=1, target="blue")
    src, tgt = ids(transformer, TEXT, "blue")
    with torch.no_grad():
        maps = transformer.model.attention_maps(torch.tensor([src]), torch.tensor([tgt]))
    torch.testing.assert_close(t(s["weights"]), maps.cross[1][0, 1].double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_next_token_probabilities_are_the_forward_passes_at_the_temperature(transformer, temperature):
    target = "blue cat"
    s = lecture.attention_steps(transformer, TEXT, target=target, temperature=temperature, position=2)
    src, tgt = ids(transformer, TEXT, target)
    with torch.no_grad():
        logits = transformer.model(torch.tensor([src]), torch.tensor([tgt]))[0]  # (T, V)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    nxt = s["next"]
    assert nxt["position"] == 2 and len(nxt["top"]) == len(tgt)
    for i, row in enumerate(nxt["top"]):
        best = probs[i].topk(len(row))
        assert [c["id"] for c in row] == best.indices.tolist()
        assert [c["p"] for c in row] == pytest.approx(best.values.tolist(), abs=1e-5)
        assert [c["p1"] for c in row] == pytest.approx(torch.softmax(logits[i].double(), -1)[best.indices].tolist(),
                                                       abs=1e-5)
    p = probs[2]
    assert nxt["entropy"][2] == pytest.approx(-(p * p.log()).sum().item(), abs=1e-4)


def test_temperature_sharpens_and_flattens(transformer):
    ent = {temp: lecture.attention_steps(transformer, TEXT, target="blue", temperature=temp)["next"]["entropy"][0]
           for temp in (0.25, 1.0, 4.0)}
    assert ent[0.25] < ent[1.0] < ent[4.0]


def test_a_language_model_step_by_step():
    lm = load(FIXTURES / "lm-transformer")
    s = lecture.attention_steps(lm, TEXT, layer=0, head=0)
    assert s["kinds"] == ["decoder_self"] and s["queries"] == "text"
    ids_ = lm.prompt_ids(TEXT)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids_]))[0]
        maps = lm.model.attention_maps(torch.tensor([ids_]))
    torch.testing.assert_close(t(s["weights"]), maps[0][0, 0].double(), atol=1e-5, rtol=1e-4)
    last = s["next"]["top"][-1]
    p = torch.softmax(logits[-1].double(), -1)
    assert last[0]["id"] == int(p.argmax()) and last[0]["p"] == pytest.approx(p.max().item(), abs=1e-5)


@pytest.mark.parametrize("kwargs, field", [({"kind": "bogus"}, "kind"), ({"layer": 2}, "layer"),
                                           ({"head": -1}, "head"), ({"temperature": 0.0}, "temperature"),
                                           ({"temperature": 9.0}, "temperature"), ({"position": 99}, "position")])
def test_steps_refuse_by_field(transformer, kwargs, field):
    with pytest.raises(LectureError, match=f"^{field}: "):
        lecture.attention_steps(transformer, TEXT, target="blue", **kwargs)


def test_steps_refuse_an_rnn_and_an_empty_text(transformer, lstm):
    with pytest.raises(LectureError, match="for Transformer runs"):
        lecture.attention_steps(lstm, TEXT)
    with pytest.raises(LectureError, match="^text: "):
        lecture.attention_steps(transformer, "  ")
    with pytest.raises(LectureError, match="at most 64"):
        lecture.attention_steps(transformer, "ab" * 40)


# --- 2. the model view: every layer and head --------------------------------------------------------------

def test_model_view_weights_are_the_plain_torch_ones(transformer):
    """The model view draws /inside's attention (qkv.viz.attention_data): every kind, layer and head
    equals the plain-torch recomputation."""
    from qkv.viz import attention_data

    data = attention_data(transformer, TEXT, "blue cat")
    src, tgt = ids(transformer, TEXT, "blue cat")
    with torch.no_grad():
        ref = plain(transformer.model, src, tgt)
    cfg = transformer.model.cfg
    for kind in ("encoder", "decoder_self", "cross"):
        grid = data["weights"][kind]
        assert len(grid) == (cfg.n_encoder_layers if kind == "encoder" else cfg.n_decoder_layers)
        for li, layer in enumerate(grid):
            assert len(layer) == cfg.n_heads
            for hi, w in enumerate(layer):
                torch.testing.assert_close(t(w), ref[kind][li][2][hi][3].double(), atol=1e-5, rtol=1e-4)


# --- 3. RNN gates and the gradient reaching each input ------------------------------------------------------

def torch_lstm_steps(weights, x, reverse=False):
    """Gates (i, f, g, o) from torch's documented equations and h, c from torch.nn.LSTMCell."""
    w_ih, w_hh, b_ih, b_hh = weights
    hidden = w_hh.size(1)
    cell = torch.nn.LSTMCell(x.size(1), hidden)
    with torch.no_grad():
        for p, w in zip((cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh), weights):
            p.copy_(w)
    h = c = torch.zeros(1, hidden)
    gates, hs = {}, {}
    for s in (reversed(range(len(x))) if reverse else range(len(x))):
        g = x[s] @ w_ih.T + b_ih + h[0] @ w_hh.T + b_hh
        i, f, gg, o = g.chunk(4)
        gates[s] = (torch.sigmoid(i), torch.sigmoid(f), torch.tanh(gg), torch.sigmoid(o))
        h, c = cell(x[s][None], (h, c))
        hs[s] = h[0]
    order = range(len(x))
    return {n: torch.stack([gates[s][k] for s in order]) for k, n in enumerate(("input", "forget", "candidate",
                                                                                   "output"))}, \
        torch.stack([hs[s] for s in order])


def first_layer(rnn, x):
    """The first layer's outputs ``(S, H·dirs)`` of a stacked nn.LSTM, by an nn.LSTM of that layer alone."""
    one = torch.nn.LSTM(rnn.input_size, rnn.hidden_size, bidirectional=rnn.bidirectional, batch_first=True)
    one.load_state_dict({k: v for k, v in rnn.state_dict().items() if k.endswith(("l0", "l0_reverse"))})
    return one(x[None])[0][0]


@pytest.mark.parametrize("direction", [0, 1])
def test_lstm_gates_from_the_equations_and_lstmcell(lstm, direction):
    g = lecture.rnn_gates(lstm, TEXT, direction=direction)
    model = lstm.model
    src = lstm.tokenizers.src.encode([TEXT])[0] + [3]
    assert g["arch"] == "lstm" and g["tokens"] == [lstm.tokenizers.src.id_to_piece(i) for i in src]
    rnn = model.encoder.rnn
    sfx = "l0" + ("_reverse" if direction else "")
    weights = [getattr(rnn, f"{n}_{sfx}").detach() for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    with torch.no_grad():
        x = model.src_embed.weight[src]
        gates, h = torch_lstm_steps(weights, x, reverse=bool(direction))
        states = first_layer(model.encoder.rnn, x)  # nn.LSTM, both directions
    for name, want in gates.items():
        torch.testing.assert_close(t(g["gates"][name]).float(), want, atol=1e-4, rtol=1e-3)
        assert g["mean"][name] == pytest.approx(want.mean(-1).tolist(), abs=1e-4)
    torch.testing.assert_close(t(g["h"]).float(), h, atol=1e-4, rtol=1e-3)
    hidden = model.encoder.hidden_size
    torch.testing.assert_close(h, states[:, direction * hidden:(direction + 1) * hidden], atol=1e-5, rtol=1e-4)
    assert g["h_norm"] == pytest.approx(h.norm(dim=-1).tolist(), abs=1e-4)
    assert len(g["c_norm"]) == len(src)


def test_lstm_second_layer_reads_the_first(lstm):
    g = lecture.rnn_gates(lstm, TEXT, layer=1)
    model = lstm.model
    src = lstm.tokenizers.src.encode([TEXT])[0] + [3]
    with torch.no_grad():
        out0, _ = model.encoder.rnn(model.src_embed.weight[src][None])  # (1, S, 2H): both layers, nn.LSTM
        rnn = model.encoder.rnn
        first = first_layer(rnn, model.src_embed.weight[src])
        weights = [getattr(rnn, f"{n}_l1").detach() for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        gates, h = torch_lstm_steps(weights, first)
    torch.testing.assert_close(t(g["h"]).float(), h, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(h, out0[0][:, :rnn.hidden_size], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(t(g["gates"]["forget"]).float(), gates["forget"], atol=1e-4, rtol=1e-3)


def gru_translator(base):
    from qkv.frontends.translator import Translator
    from qkv.models.rnn_seq2seq import RNNSeq2Seq

    torch.manual_seed(5)
    cfg = replace(base.model.cfg, arch="gru", n_encoder_layers=1, n_decoder_layers=1)
    return Translator(RNNSeq2Seq(cfg).eval(), base.tokenizers, base.decode_cfg)


def test_gru_gates_from_the_equations_and_grucell(lstm):
    gru = gru_translator(lstm)
    g = lecture.rnn_gates(gru, TEXT)
    model = gru.model
    src = gru.tokenizers.src.encode([TEXT])[0] + [3]
    rnn = model.encoder.rnn
    w_ih, w_hh, b_ih, b_hh = [getattr(rnn, f"{n}_l0").detach() for n in ("weight_ih", "weight_hh", "bias_ih",
                                                                         "bias_hh")]
    hidden = rnn.hidden_size
    cell = torch.nn.GRUCell(rnn.input_size, hidden)
    with torch.no_grad():
        for p, w in zip((cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh), (w_ih, w_hh, b_ih, b_hh)):
            p.copy_(w)
        x = model.src_embed.weight[src]
        h = torch.zeros(1, hidden)
        r_s, z_s, h_s = [], [], []
        for s in range(len(src)):  # torch's documented GRU: r, z, n = ..., h' = (1 - z) n + z h
            gi, gh = x[s] @ w_ih.T + b_ih, h[0] @ w_hh.T + b_hh
            r = torch.sigmoid(gi[:hidden] + gh[:hidden])
            z = torch.sigmoid(gi[hidden:2 * hidden] + gh[hidden:2 * hidden])
            n = torch.tanh(gi[2 * hidden:] + r * gh[2 * hidden:])
            h_new = cell(x[s][None], h)
            torch.testing.assert_close(h_new[0], (1 - z) * n + z * h[0], atol=1e-5, rtol=1e-4)
            h = h_new
            r_s.append(r), z_s.append(z), h_s.append(h[0])
    assert set(g["gates"]) == {"reset", "update", "candidate"} and "c_norm" not in g
    torch.testing.assert_close(t(g["gates"]["reset"]).float(), torch.stack(r_s), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(t(g["gates"]["update"]).float(), torch.stack(z_s), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(t(g["h"]).float(), torch.stack(h_s), atol=1e-4, rtol=1e-3)


def test_gates_refuse_a_transformer_and_bad_fields(transformer, lstm):
    with pytest.raises(LectureError, match="not a recurrent encoder-decoder"):
        lecture.rnn_gates(transformer, TEXT)
    with pytest.raises(LectureError, match="^layer: "):
        lecture.rnn_gates(lstm, TEXT, layer=2)
    with pytest.raises(LectureError, match="^direction: "):
        lecture.rnn_gates(lstm, TEXT, direction=2)


def test_gradient_norms_of_a_hand_solved_linear_recurrence():
    """h_t = W h_{t-1} + U x_t with W = 0.5·I, U = I (a ReLU RNN on positive inputs is linear), loss =
    Σ h_T: ∂loss/∂x_t = Uᵀ (Wᵀ)^(T-1-t) 1 = 0.5^(T-1-t)·(1, 1), of norm √2·0.5^(T-1-t)."""
    from qkv.nn.recurrent import Recurrent

    rnn = Recurrent("rnn", 2, 2, nonlinearity="relu")
    with torch.no_grad():
        rnn.rnn.weight_hh_l0.copy_(0.5 * torch.eye(2))
        rnn.rnn.weight_ih_l0.copy_(torch.eye(2))
        rnn.rnn.bias_hh_l0.zero_(), rnn.rnn.bias_ih_l0.zero_()
    x = torch.rand(6, 2) + 0.1
    loss, norms = lecture.gradient_norms(lambda v: rnn(v[None])[0][0, -1].sum(), x)
    assert norms.tolist() == pytest.approx([math.sqrt(2) * 0.5 ** (5 - s) for s in range(6)], rel=1e-5)
    h = torch.zeros(2)
    for s in range(6):
        h = 0.5 * h + x[s]
    assert loss == pytest.approx(h.sum().item(), rel=1e-5)


def shifted_loss(model, src, tgt, tgt_out, keep, shift):
    """torch's cross-entropy of the model's forward pass with ``shift (S, d)`` added to the source's
    embedding output (a forward hook, written here)."""
    def hook(module, args, output):
        if args[0].size(1) == len(src) and torch.equal(args[0][0], torch.tensor(src)):
            return output + shift[None].to(output.dtype)
        return output
    handle = model.src_embed.register_forward_hook(hook)
    try:
        logits = model(torch.tensor([src]), torch.tensor([tgt]))[0]
    finally:
        handle.remove()
    return F.cross_entropy(logits[keep], torch.tensor(tgt_out)[keep], reduction="sum")


@pytest.mark.parametrize("which", ["transformer", "lstm"])
@pytest.mark.parametrize("scope", ["all", "last", "first"])
def test_input_gradients_are_those_of_the_cross_entropy(which, scope, request):
    """‖∂loss/∂x_t‖ against the gradient of torch's cross-entropy with respect to a shift of the
    embedding output, by backward() on a leaf of the test's own."""
    fr = request.getfixturevalue(which)
    target = "blue cat"
    got = lecture.input_gradients(fr, TEXT, target=target, scope=scope)
    model = fr.model.eval()
    src, tgt = ids(fr, TEXT, target)
    tgt_out = tgt[1:] + [3]
    keep = {"all": list(range(len(tgt_out))), "last": [len(tgt_out) - 1], "first": [0]}[scope]
    shift = torch.zeros(len(src), model.cfg.d_model, requires_grad=True)
    loss = shifted_loss(model, src, tgt, tgt_out, keep, shift)
    loss.backward()
    model.zero_grad(set_to_none=True)
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["norms"] == pytest.approx(shift.grad.norm(dim=-1).tolist(), rel=1e-4, abs=1e-8)
    assert got["tokens"] == [fr.tokenizers.src.id_to_piece(i) for i in src] and got["scope"] == scope


def test_input_gradient_matches_finite_differences(transformer):
    """One position's gradient, component by component, by central differences of the float64 model."""
    target, pos = "blue cat", 2
    got = lecture.input_gradients(transformer, TEXT, target=target)
    model = transformer.model
    src, tgt = ids(transformer, TEXT, target)
    tgt_out = tgt[1:] + [3]
    keep = list(range(len(tgt_out)))
    model.double()
    try:
        grad, eps = torch.zeros(model.cfg.d_model, dtype=torch.float64), 1e-5
        with torch.no_grad():
            for j in range(model.cfg.d_model):
                e = torch.zeros(len(src), model.cfg.d_model, dtype=torch.float64)
                e[pos, j] = eps
                grad[j] = (shifted_loss(model, src, tgt, tgt_out, keep, e) -
                           shifted_loss(model, src, tgt, tgt_out, keep, -e)).item() / (2 * eps)
    finally:
        model.float()
    assert got["norms"][pos] == pytest.approx(grad.norm().item(), rel=1e-3)


def test_gradients_refuse_a_bad_scope(transformer):
    with pytest.raises(LectureError, match="^scope: "):
        lecture.input_gradients(transformer, TEXT, scope="middle")


# --- the routes -------------------------------------------------------------------------------------------

fastapi = pytest.importorskip("fastapi", reason='qkv lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from qkv.lab.app import create_app
    from qkv.lab.runs import Lab, LabLimits

    root = tmp_path_factory.mktemp("lab") / "runs"
    for name, ckpt in (("tr", "translate-transformer"), ("lstm", "translate-lstm-general")):
        (root / name).mkdir(parents=True)
        shutil.copytree(FIXTURES / ckpt, root / name / "last")
        (root / name / "lab.json").write_text(json.dumps({"name": name, "task": "copy", "preset": "x"}))
    lab = Lab(root, LabLimits(max_chars=50))
    with TestClient(create_app(lab, panels=None), base_url="http://127.0.0.1") as c:
        yield c


def test_routes_answer_what_the_functions_compute(client, transformer, lstm):
    r = client.post("/api/runs/tr/steps", json={"text": TEXT, "kind": "cross", "layer": 1, "head": 1,
                                                "target": "blue", "temperature": 0.5})
    assert r.status_code == 200, r.json()
    want = lecture.attention_steps(transformer, TEXT, kind="cross", layer=1, head=1, target="blue", temperature=0.5)
    assert r.json()["weights"] == json.loads(json.dumps(want))["weights"] and r.json()["run"] == "tr"
    r = client.post("/api/runs/lstm/gates", json={"text": TEXT, "direction": 1})
    assert r.status_code == 200 and r.json()["mean"] == lecture.rnn_gates(lstm, TEXT, direction=1)["mean"]
    r = client.post("/api/runs/lstm/gradients", json={"text": TEXT, "scope": "last", "target": "blue"})
    assert r.status_code == 200
    assert r.json()["norms"] == pytest.approx(lecture.input_gradients(lstm, TEXT, "blue", "last")["norms"], rel=1e-5)


@pytest.mark.parametrize("path, body, status, message", [
    ("tr/steps", {"text": TEXT, "layer": 7}, 422, "layer: must be a whole number from 0 to 1"),
    ("tr/steps", {"text": TEXT, "temperature": "hot"}, 422, "temperature"),
    ("tr/steps", {"text": "x" * 51}, 413, "at most 50"),
    ("tr/gates", {"text": TEXT}, 422, "not a recurrent encoder-decoder"),
    ("lstm/steps", {"text": TEXT}, 422, "for Transformer runs"),
    ("nobody/steps", {"text": TEXT}, 404, "no run named 'nobody'"),
    ("lstm/gradients", {"text": TEXT, "scope": "x"}, 422, "scope: one of all, last, first"),
])
def test_route_errors_are_json(client, path, body, status, message):
    r = client.post(f"/api/runs/{path}", json=body)
    assert r.status_code == status and message in r.json()["error"], r.json()

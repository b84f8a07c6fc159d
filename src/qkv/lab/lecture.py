"""The lecture's look-inside pieces for one typed input through a run's checkpoint, each computed by
qkv's own modules:

=========================  =======================================================================
function                   what it gives
=========================  =======================================================================
``attention_steps``        one attention computation step by step, for a chosen kind, layer and
                           head of a Transformer: token embeddings·√d_model and positions, the
                           layer's input, Q, K and V of the head, QKᵀ, the scaling by √d_k, the
                           mask, the softmax, the weighted sum; and the next-token probabilities
                           at a temperature (a translation or language model)
``rnn_gates``              an LSTM's input/forget/output gates or a GRU's update/reset gates at
                           every source position, from the encoder's own cells
``input_gradients``        ‖∂loss/∂x_t‖ for every source position t: how much of the training
                           loss's gradient reaches each input vector (a Transformer's or an RNN's)
=========================  =======================================================================

The model view (every layer and head at once) is :func:`qkv.viz.attention_data`, which the lab's
``/inside`` answers already. ``register(app, lab, checkpoints)`` adds the routes::

    POST /api/runs/NAME/steps      {"text", "kind", "layer", "head", "target", "temperature", "position"}
    POST /api/runs/NAME/gates      {"text", "layer", "direction"}
    POST /api/runs/NAME/gradients  {"text", "target", "scope"}
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qkv.errors import QkvError

MAX_TOKENS = 64  # per side: the matrices the page draws stay small
TEMPERATURE = (0.05, 5.0)
TOP = 12  # next-token candidates shown per position


class LectureError(QkvError):
    """A request this model cannot answer (a kind it lacks, a layer out of range): status 422."""

    status = 422


def _rows(t: torch.Tensor, digits: int = 5) -> list:
    """A tensor as nested lists of rounded floats; -inf (a masked score) as None."""
    def one(x: float):
        return None if math.isinf(x) and x < 0 else round(x, digits)
    if t.dim() == 1:
        return [one(x) for x in t.tolist()]
    return [_rows(r, digits) for r in t]


def _bounded(name: str, value: int, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LectureError(f"{name}: must be a whole number from {lo} to {hi}, got {value!r}")
    return value


def _check_tokens(n: int, side: str) -> None:
    """Refused before the model runs: a long input is never decoded only to be turned away."""
    if n > MAX_TOKENS:
        raise LectureError(f"text: the {side} is {n} tokens; this view takes at most {MAX_TOKENS}")


# --- the model's sides ---------------------------------------------------------------------------------

def _inputs(frontend, text: str, target: str | None) -> dict:
    """What the model reads for ``text``: the stacks it has, their token ids and pieces.

    translate (Transformer): ``src`` (pieces + EOS) and ``tgt_in`` (BOS + the target's pieces; the
    greedy output when ``target`` is None); lm: ``tokens`` (the prompt's pieces); classify / mlm:
    ``tokens`` (``<cls>`` + pieces)."""
    from qkv.tasks import get_task

    if not text.strip():
        raise LectureError("text: give a non-empty input")
    model = frontend.model
    cfg = model.cfg
    task = get_task(cfg.task)
    if cfg.is_recurrent:
        raise LectureError(f"this run is a {cfg.arch}: the step-by-step view is for Transformer runs "
                           f"(an RNN run has gates: see the gates panel)")
    if task.stack == "encoder-decoder":
        from qkv.data.batching import collate
        from qkv.viz import attention_data

        tok = frontend.tokenizers
        src_ids = tok.src.encode([text])[0]
        _check_tokens(len(src_ids) + 1, "source")  # pieces + EOS: before any decoding
        if target is not None:
            _check_tokens(len(tok.tgt.encode([target])[0]) + 1, "target")  # BOS + pieces
        else:
            target = attention_data(frontend, text)["target"]  # the greedy output, as /inside shows it
        tgt_ids = tok.tgt.encode([target])[0] if target else []
        batch = collate([src_ids], [tgt_ids])
        _check_tokens(batch.src.size(1), "source")
        _check_tokens(batch.tgt_in.size(1), "target")
        return {"stack": "encoder-decoder", "src": batch.src, "tgt_in": batch.tgt_in, "target": target,
                "pieces": {"source": [tok.src.id_to_piece(i) for i in batch.src[0].tolist()],
                           "target": [tok.tgt.id_to_piece(i) for i in batch.tgt_in[0].tolist()]}}
    if task.stack == "decoder" and task.data_kind == "text":  # lm
        ids = frontend.prompt_ids(text)
        _check_tokens(len(ids), "text")
        return {"stack": "decoder", "tokens": torch.tensor([ids]), "target": None,
                "pieces": {"text": [frontend.tokenizer.id_to_piece(i) for i in ids]}}
    if task.stack == "encoder":
        tokens = frontend.input_tokens(text)
        _check_tokens(tokens.size(1), "text")
        return {"stack": "encoder", "tokens": tokens, "target": None,
                "pieces": {"text": [frontend.tokenizers.src.id_to_piece(i) for i in tokens[0].tolist()]}}
    raise LectureError(f"the step-by-step view has no {cfg.task!r} models yet")


KINDS = {  # stack -> the attention kinds it has: (title, query side, key side)
    "encoder-decoder": {"encoder": ("encoder self-attention", "source", "source"),
                        "decoder_self": ("decoder masked self-attention", "target", "target"),
                        "cross": ("cross-attention", "target", "source")},
    "decoder": {"decoder_self": ("masked self-attention", "text", "text")},
    "encoder": {"encoder": ("self-attention", "text", "text")},
}


def _layer_input(model, stack_kind: str, inputs: dict, kind: str, layer: int) -> dict:
    """Run qkv's own stack up to ``layer``: the embeddings, positions, their sum, and the residual
    stream entering that layer's attention sublayer (for cross-attention: after its masked
    self-attention sublayer), with the keys' side for cross-attention (the encoder's output)."""
    from qkv.masks import causal_mask, padding_mask

    out: dict = {}
    if stack_kind == "encoder-decoder":
        src, tgt_in = inputs["src"], inputs["tgt_in"]
        memory, memory_mask, _ = model.encode(src)
        if kind == "encoder":
            stack, tokens, run = model.encoder, src, (lambda lay, x: lay(x, mask=memory_mask)[0])
            mask = padding_mask(src)[0, 0].expand(src.size(1), -1)  # (S, S)
        else:
            kv = model.memory_kv(memory)
            stack, tokens = model.decoder, tgt_in
            layers = list(stack.layers)
            run = (lambda lay, x: lay(x, kv[layers.index(lay)], memory_mask)[0])
            t = tgt_in.size(1)
            mask = causal_mask(t)[0, 0] if kind == "decoder_self" else padding_mask(src)[0, 0].expand(t, -1)
        out["memory"] = memory[0]
    elif stack_kind == "decoder":
        tokens = inputs["tokens"]
        stack, run = model.decoder, (lambda lay, x: lay(x, causal=True)[0])
        mask = causal_mask(tokens.size(1))[0, 0]
    else:
        tokens = inputs["tokens"]
        stack = model.encoder
        pad = padding_mask(tokens)
        run = (lambda lay, x: lay(x, mask=pad)[0])
        mask = pad[0, 0].expand(tokens.size(1), -1)
    embedding = stack.embed(tokens)[0]  # (T, d): E[token]·√d_model
    positions = stack.pos(tokens.size(1))[0]  # (T, d)
    x = stack.inputs(tokens)  # (1, T, d): the sum, as the stack computes it (eval: no dropout)
    out.update(embedding=embedding, positions=positions, x0=x[0])
    for lay in list(stack.layers)[:layer]:
        x = run(lay, x)
    lay = stack.layers[layer]
    out["layer_input"] = x[0]
    if kind == "cross":
        res_self = lay.res_self
        a = lay.self_attn.self_attention(res_self.before(x), causal=True)[0]
        x = res_self.after(x, a)
        out["after_self"] = x[0]
        out["query_input"] = lay.res_cross.before(x)[0]
        out["key_input"] = out["memory"]
        out["attn"] = lay.cross_attn
    else:
        res = lay.res_attn if hasattr(lay, "res_attn") else lay.res_self
        out["query_input"] = out["key_input"] = res.before(x)[0]
        out["attn"] = lay.self_attn
    out["mask"] = mask
    return out


def attention_steps(frontend, text: str, kind: str | None = None, layer: int = 0, head: int = 0,
                    target: str | None = None, temperature: float = 1.0, position: int | None = None) -> dict:
    """One attention computation of a Transformer run written out, for ``text`` (the source of a
    translation model; the text of a language model or an encoder):

    ``embedding`` E[token]·√d_model, ``positions`` PE, ``x0`` their sum (what the first layer reads);
    ``layer_input`` the residual stream entering layer ``layer``; ``query_input`` / ``key_input`` what
    the attention sublayer reads (LayerNorm'd under pre-norm; for cross-attention the decoder's state
    after its masked self-attention, and the encoder's output); ``q``, ``k``, ``v`` = input·W + b of head
    ``head`` (d_k columns of the layer's fused projection); ``scores`` QKᵀ; ``scaled`` QKᵀ/√d_k;
    ``mask`` (True = may attend); ``masked`` (None where masked: −∞); ``weights`` the softmax;
    ``output`` weights·V (the head's d_v columns before W^O). ``next`` (translation and language
    models): at each position of the decoder's input, the top tokens of softmax(logits / temperature)
    (:func:`qkv.decoding.sampling.apply_temperature`), the model's own forward logits."""
    from qkv.decoding.sampling import apply_temperature

    model = frontend.model
    inputs = _inputs(frontend, text, target)
    stack_kind = inputs["stack"]
    kinds = KINDS[stack_kind]
    kind = kind or next(iter(kinds))
    if kind not in kinds:
        raise LectureError(f"kind: this model has {', '.join(kinds)}, not {kind!r}")
    cfg = model.cfg
    n_layers = cfg.n_encoder_layers if kind == "encoder" else cfg.n_decoder_layers
    _bounded("layer", layer, 0, n_layers - 1)
    _bounded("head", head, 0, cfg.n_heads - 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not TEMPERATURE[0] <= temperature <= TEMPERATURE[1]:
        raise LectureError(f"temperature: must be a number from {TEMPERATURE[0]:g} to {TEMPERATURE[1]:g}, "
                           f"got {temperature!r}")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            s = _layer_input(model, stack_kind, inputs, kind, layer)
            attn = s["attn"]
            d, d_k = attn.d_model, attn.d_k
            w, b = attn.in_proj.weight, attn.in_proj.bias  # (3d, d), (3d,): [W^Q; W^K; W^V] of every head
            cols = slice(head * d_k, (head + 1) * d_k)

            def project(x, part):  # part 0, 1, 2: Q, K, V; the head's d_k rows of that block
                rows = slice(part * d + cols.start, part * d + cols.stop)
                return F.linear(x, w[rows], b[rows])  # (T, d_k)

            q, k, v = project(s["query_input"], 0), project(s["key_input"], 1), project(s["key_input"], 2)
            scores = q @ k.T  # (T_q, T_k)
            scaled = scores / math.sqrt(d_k)
            masked = scaled.masked_fill(~s["mask"], float("-inf"))
            weights = masked.softmax(dim=-1)
            output = weights @ v  # (T_q, d_k)
            out = {"model": _describe(cfg, stack_kind), "kind": kind, "title": kinds[kind][0], "layer": layer,
                   "head": head, "n_layers": n_layers, "n_heads": cfg.n_heads, "kinds": list(kinds),
                   "d_model": d, "d_k": d_k, "norm_first": cfg.norm_first, "positional": cfg.positional,
                   "target": inputs["target"], "tokens": inputs["pieces"],
                   "queries": kinds[kind][1], "keys": kinds[kind][2], "scale": math.sqrt(d_k)}
            for name in ("embedding", "positions", "x0", "layer_input", "query_input", "key_input"):
                out[name] = _rows(s[name], 4)
            out.update(q=_rows(q, 4), k=_rows(k, 4), v=_rows(v, 4), scores=_rows(scores, 4),
                       scaled=_rows(scaled, 4), mask=s["mask"].tolist(), masked=_rows(masked, 4),
                       weights=_rows(weights, 5), output=_rows(output, 4))
            logits = _next_logits(model, stack_kind, inputs)
            if logits is not None:
                out["next"] = _next(frontend, stack_kind, logits, apply_temperature(logits, float(temperature)),
                                    position)
                out["temperature"] = float(temperature)
            return out
    finally:
        model.train(was_training)


def _describe(cfg, stack_kind: str) -> str:
    what = {"encoder-decoder": "Transformer encoder-decoder", "decoder": "decoder-only Transformer",
            "encoder": "encoder-only Transformer"}[stack_kind]
    return (f"{what}: {cfg.n_encoder_layers if stack_kind != 'decoder' else cfg.n_decoder_layers} layers, "
            f"d_model {cfg.d_model}, {cfg.n_heads} heads, "
            f"{'no positional encoding' if cfg.positional == 'none' else cfg.positional + ' positions'}, "
            f"{'pre' if cfg.norm_first else 'post'}-norm")


def _next_logits(model, stack_kind: str, inputs: dict) -> torch.Tensor | None:
    """The model's own next-token logits ``(T, V)`` at every position of the decoder's input."""
    if stack_kind == "encoder-decoder":
        return model(inputs["src"], inputs["tgt_in"])[0]
    if stack_kind == "decoder":
        return model(inputs["tokens"])[0]
    return None


def _next(frontend, stack_kind: str, logits: torch.Tensor, tempered: torch.Tensor, position: int | None) -> dict:
    """Per position: the top tokens of softmax(tempered) with their probabilities (and at T = 1)."""
    tok = frontend.tokenizers.tgt if stack_kind == "encoder-decoder" else frontend.tokenizer
    t = logits.size(0)
    position = t - 1 if position is None else _bounded("position", position, 0, t - 1)
    probs, plain = tempered.float().softmax(-1), logits.float().softmax(-1)  # (T, V)
    top = probs.topk(min(TOP, probs.size(-1)), dim=-1)
    rows = []
    for i in range(t):
        rows.append([{"token": tok.id_to_piece(j), "id": j, "p": round(p, 6), "p1": round(plain[i, j].item(), 6)}
                     for p, j in zip(top.values[i].tolist(), top.indices[i].tolist())])
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    return {"position": position, "top": rows, "entropy": [round(x, 5) for x in entropy.tolist()],
            "vocab_size": probs.size(-1)}


# --- RNN gates -------------------------------------------------------------------------------------------

GATE_NAMES = {"lstm": ("input", "forget", "candidate", "output"), "gru": ("reset", "update", "candidate")}


def _recurrent_source(frontend, text: str):
    model = frontend.model
    cfg = model.cfg
    if not cfg.is_recurrent or not hasattr(model, "encoder") or cfg.task != "translate":
        raise LectureError("this run is not a recurrent encoder-decoder: gates and hidden states are for "
                           "lstm, gru and rnn runs")
    if not text.strip():
        raise LectureError("text: give a non-empty input")
    from qkv.data.batching import collate

    tok = frontend.tokenizers.src
    src = collate([tok.encode([text])[0]], None).src  # (1, S): pieces + EOS
    _check_tokens(src.size(1), "source")
    return model, src, [tok.id_to_piece(i) for i in src[0].tolist()]


def rnn_gates(frontend, text: str, layer: int = 0, direction: int = 0) -> dict:
    """The encoder's gates at each source position, from its own cells (:meth:`Recurrent.cell`,
    :meth:`LSTMCell.gates` / :meth:`GRUCell.gates`) stepped over ``text`` (pieces + EOS) from a zero
    state: ``gates[name]`` ``(S, H)`` (an LSTM: input, forget, candidate, output; a GRU: reset, update,
    candidate), ``mean[name]`` their mean over the H units at each position, ``h`` ``(S, H)`` and
    ``h_norm``; an LSTM also ``c_norm`` (its memory cell). ``direction`` 1: the backward cell of a
    bidirectional encoder, which reads the source from its end (positions are still source order)."""
    model, src, pieces = _recurrent_source(frontend, text)
    enc = model.encoder
    _bounded("layer", layer, 0, enc.num_layers - 1)
    _bounded("direction", direction, 0, enc.num_directions - 1)
    kind = enc.kind
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            x = model.src_embed(src)  # (1, S, d): what the encoder reads (eval: no dropout)
            for lower in range(layer):  # the layers below, by the same cells
                x = torch.cat([_run_cell(enc, lower, d, x)[0] for d in range(enc.num_directions)], dim=-1)[None]
            h, c, gates = _run_cell(enc, layer, direction, x)
    finally:
        model.train(was_training)
    names = GATE_NAMES.get(kind, ())
    out = {"arch": kind, "layer": layer, "direction": direction, "directions": enc.num_directions,
           "layers": enc.num_layers, "hidden_size": enc.hidden_size, "tokens": pieces,
           "gates": {n: _rows(gates[n], 4) for n in names},
           "mean": {n: [round(v, 5) for v in gates[n].mean(-1).tolist()] for n in names},
           "h": _rows(h, 4), "h_norm": [round(v, 5) for v in h.norm(dim=-1).tolist()]}
    if c is not None:
        out["c_norm"] = [round(v, 5) for v in c.norm(dim=-1).tolist()]
    if not names:
        out["note"] = "a vanilla RNN has no gates: h_t = tanh(W·x_t + U·h_{t−1} + b) at every step"
    return out


def _run_cell(enc, layer: int, direction: int, x: torch.Tensor):
    """Step the cell of ``layer`` and ``direction`` over ``x (1, S, I)`` from a zero state: h ``(S, H)``,
    c ``(S, H)`` or None, and the gates ``{name: (S, H)}``, all in source order."""
    cell = enc.cell(layer, direction)
    s, hidden = x.size(1), enc.hidden_size
    h = x.new_zeros(1, hidden)
    c = x.new_zeros(1, hidden) if enc.kind == "lstm" else None
    hs, cs, gates = [None] * s, [None] * s, {n: [None] * s for n in GATE_NAMES.get(enc.kind, ())}
    for t in (range(s) if direction == 0 else reversed(range(s))):
        xt = x[:, t]
        if enc.kind == "lstm":
            for n, g in zip(GATE_NAMES["lstm"], cell.gates(xt, h)):
                gates[n][t] = g[0]
            h, c = cell(xt, (h, c))
            cs[t] = c[0]
        elif enc.kind == "gru":
            for n, g in zip(GATE_NAMES["gru"], cell.gates(xt, h)):
                gates[n][t] = g[0]
            h = cell(xt, h)
        else:
            h = cell(xt, h)
        hs[t] = h[0]
    return torch.stack(hs), None if c is None else torch.stack(cs), {n: torch.stack(v) for n, v in gates.items()}


# --- gradients back to the inputs ------------------------------------------------------------------------

SCOPES = ("all", "last", "first")


def gradient_norms(loss_of, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``loss_of(x)`` for inputs ``x (T, d)`` and ‖∂loss/∂x_t‖ ``(T,)`` by autograd."""
    x = x.detach().clone().requires_grad_(True)
    loss = loss_of(x)
    (grad,) = torch.autograd.grad(loss, [x])
    return loss.item(), grad.norm(dim=-1)


def input_gradients(frontend, text: str, target: str | None = None, scope: str = "all") -> dict:
    """‖∂loss/∂x_t‖ for each source position t of a translation run (Transformer or RNN): x_t is the
    vector the encoder reads at t (the token's embedding; a Transformer adds its position to it, which
    changes nothing in the gradient), the loss qkv's training loss (:func:`qkv.losses.label_smoothed_nll_loss`,
    ε = 0: the negative log-likelihood) of ``target`` (default: the model's greedy output) given
    ``text``, teacher-forced, over every target token (``scope`` "all"), the last one (EOS, "last"),
    or the first ("first"). Where the gradient reaching x_t is small, the loss barely depends on
    input t: the vanishing gradient of a recurrent model over long distances."""
    from qkv.config import PAD
    from qkv.data.batching import collate
    from qkv.losses import label_smoothed_nll_loss
    from qkv.viz import attention_data

    if scope not in SCOPES:
        raise LectureError(f"scope: one of {', '.join(SCOPES)}, got {scope!r}")
    model = frontend.model
    cfg = model.cfg
    if cfg.task != "translate":
        raise LectureError("the gradient view is for translation runs (encoder-decoders)")
    if not text.strip():
        raise LectureError("text: give a non-empty input")
    tok = frontend.tokenizers
    _check_tokens(len(tok.src.encode([text])[0]) + 1, "source")  # pieces + EOS: before any decoding
    if target is None:
        if getattr(model, "has_attention", True):
            target = attention_data(frontend, text)["target"]
        else:
            target = frontend.translate([text], beam_size=1)[0]
    batch = collate([tok.src.encode([text])[0]], [tok.tgt.encode([target])[0] if target else []])
    _check_tokens(batch.src.size(1), "source")
    tgt_out = batch.tgt_out.clone()
    if scope == "last":
        tgt_out[:, :-1] = PAD
    elif scope == "first":
        tgt_out[:, 1:] = PAD
    src = batch.src
    grabbed: dict = {}

    def swap(module, args, output):  # the source's embedding output replaced by the leaf x
        if args[0] is src and "x" in grabbed:
            return grabbed["x"][None].to(output.dtype)
        return output

    was_training = model.training
    model.eval()
    handle = model.src_embed.register_forward_hook(swap)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            with torch.no_grad():
                x0 = model.src_embed(src)[0]  # (S, d)

            def loss_of(x):
                grabbed["x"] = x
                logits = model(src, batch.tgt_in)  # (1, T, V)
                return label_smoothed_nll_loss(logits, tgt_out, 0.0)[0]

            loss, norms = gradient_norms(loss_of, x0)
    finally:
        handle.remove()
        model.train(was_training)
    kind = cfg.arch if cfg.is_recurrent else "transformer"
    return {"arch": kind, "attention": None if not cfg.is_recurrent else cfg.attention,
            "bidirectional": bool(cfg.bidirectional) if cfg.is_recurrent else None,
            "tokens": [tok.src.id_to_piece(i) for i in src[0].tolist()], "target": target, "scope": scope,
            "loss": loss, "norms": [float(v) for v in norms.tolist()]}


# --- routes ------------------------------------------------------------------------------------------------

def register(app, lab, checkpoints, max_chars: int | None = None) -> None:
    """``POST /api/runs/NAME/steps``, ``/gates`` and ``/gradients`` on the lab's ``app``: each runs on the
    run's newest checkpoint (``checkpoints``: :class:`qkv.lab.inside.Checkpoints`, one request at a
    time on a model). Errors are the lab's JSON ``{"error": message}`` (a QkvError's status)."""
    from fastapi.concurrency import run_in_threadpool
    from pydantic import BaseModel, ConfigDict, Field

    from qkv.lab.runs import LabError

    limit = max_chars or lab.limits.max_chars

    class Text(BaseModel):
        model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
        text: str = Field(description="the input")

    class StepsRequest(Text):
        kind: str | None = Field(None, description="encoder, decoder_self or cross (what the model has)")
        layer: int = 0
        head: int = 0
        target: str | None = Field(None, description="the decoder's input; default: the greedy output")
        temperature: float = 1.0
        position: int | None = Field(None, description="the decoder position whose next token is shown")

    class GatesRequest(Text):
        layer: int = 0
        direction: int = 0

    class GradientsRequest(Text):
        target: str | None = None
        scope: str = "all"

    async def on_run(name: str, text: str, fn, **kwargs):
        run_dir = lab.run_dir(name)
        if len(text) > limit:
            raise LabError(413, f"the text has {len(text)} characters; this lab takes at most {limit}")
        return {"run": name, **await run_in_threadpool(checkpoints.apply, run_dir, fn, text, **kwargs)}

    async def steps(name: str, req):
        return await on_run(name, req.text, attention_steps, kind=req.kind, layer=req.layer, head=req.head,
                            target=req.target, temperature=req.temperature, position=req.position)

    async def gates(name: str, req):
        return await on_run(name, req.text, rnn_gates, layer=req.layer, direction=req.direction)

    async def gradients(name: str, req):
        return await on_run(name, req.text, input_gradients, target=req.target, scope=req.scope)

    for path, fn, body, summary in (
            ("steps", steps, StepsRequest, "one attention computation step by step, and the next token"),
            ("gates", gates, GatesRequest, "an RNN encoder's gates over the source"),
            ("gradients", gradients, GradientsRequest, "‖∂loss/∂x_t‖ for every source position")):
        fn.__annotations__.update(name=str, req=body)  # the local models, not names to resolve
        app.post(f"/api/runs/{{name}}/{path}", summary=summary)(fn)


__all__ = ["attention_steps", "rnn_gates", "input_gradients", "gradient_norms", "register", "LectureError",
           "KINDS", "GATE_NAMES", "MAX_TOKENS", "TEMPERATURE"]

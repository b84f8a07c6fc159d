"""The recurrent encoder–decoder on the Transformer's interface: teacher forcing == incremental steps,
beam 1 == greedy, padding does not leak, checkpoints and the CLI work unchanged."""

import dataclasses

import pytest
import torch

from qkv.config import MODEL_PRESETS, ModelConfig
from qkv.decoding import beam_search, greedy
from qkv.errors import ConfigError
from qkv.models import build_model
from qkv.models.rnn_seq2seq import RNNSeq2Seq
from qkv.nn.scores import SCORES

V = 40


def tiny(**kw) -> ModelConfig:
    base = dict(arch="lstm", d_model=16, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                src_vocab_size=V, tgt_vocab_size=V, max_positions=32)
    base.update(kw)
    return dataclasses.replace(MODEL_PRESETS["tiny"], **base)


def batch():
    torch.manual_seed(1)
    src = torch.randint(4, V, (3, 7))
    src[1, 4:] = 0
    src[2, 2:] = 0
    tgt = torch.randint(4, V, (3, 6))
    tgt[:, 0] = 2
    return src, tgt


VARIANTS = [{"attention": a} for a in ("none",) + SCORES] + [
    {"attention": "additive", "input_feeding": True},
    {"attention": "general", "bidirectional": False},
    {"arch": "gru", "attention": "dot"},
    {"arch": "rnn", "attention": "general", "rnn_nonlinearity": "relu"},
    {"arch": "gru", "attention": "none", "n_encoder_layers": 3},
    {"attention": "scaled_dot", "share_embeddings": False, "tie_output": False},
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_incremental_decoding_equals_teacher_forcing(kw):
    torch.manual_seed(0)
    m = build_model(tiny(**kw)).eval()
    assert isinstance(m, RNNSeq2Seq)
    src, tgt = batch()
    with torch.no_grad():
        full = m(src, tgt)  # (B, T, V)
        state = m.start(src)
        steps = []
        for t in range(tgt.size(1)):
            logits, state = m.step(tgt[:, t], state)
            steps.append(logits)
    assert full.shape == (3, 6, V)
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-5)


@pytest.mark.parametrize("kw", [{"attention": "additive"}, {"attention": "none"}, {"attention": "location"},
                                {"attention": "cosine", "input_feeding": True}])
def test_padding_does_not_change_the_output(kw):
    torch.manual_seed(0)
    m = build_model(tiny(**kw)).eval()
    src = torch.tensor([[7, 8, 9, 3]])
    padded = torch.tensor([[7, 8, 9, 3, 0, 0], [5, 6, 3, 0, 0, 0]])
    tgt = torch.tensor([[2, 5, 6], [2, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(m(src, tgt[:1]), m(padded, tgt)[:1], atol=1e-5)


def test_future_target_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    m = build_model(tiny()).eval()
    src = torch.randint(4, V, (1, 5))
    with torch.no_grad():
        a, b = m(src, torch.tensor([[2, 5, 6, 7]])), m(src, torch.tensor([[2, 5, 6, 30]]))
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6)


@pytest.mark.parametrize("kw", [{"attention": "additive"}, {"attention": "none"}, {"arch": "gru", "attention": "general"}])
def test_beam_one_equals_greedy_and_greedy_equals_recomputation(kw):
    torch.manual_seed(0)
    m = build_model(tiny(**kw)).eval()
    src, _ = batch()
    max_len = torch.tensor([8, 5, 8])
    g = greedy(m, src, max_len)
    b = beam_search(m, src, beam_size=1, length_penalty=0.6, max_len=max_len)
    assert [h[0].tokens for h in b] == g
    with torch.no_grad():
        for i in range(3):
            prefix = [2]
            for _ in range(int(max_len[i])):
                logits = m(src[i : i + 1], torch.tensor([prefix]))[0, -1]
                logits[0] = logits[2] = float("-inf")  # PAD and BOS are never emitted
                tok = int(logits.argmax())
                if tok == 3:
                    break
                prefix.append(tok)
            assert prefix[1:] == g[i]
    beams = beam_search(m, src, beam_size=4, length_penalty=0.6, max_len=max_len, nbest=2)
    assert all(len(h) == 2 for h in beams)


def test_attention_maps_are_the_forward_pass_alignment():
    torch.manual_seed(0)
    m = build_model(tiny(attention="general")).eval()
    src = torch.tensor([[5, 6, 7, 3, 0]])
    a = m.attention_maps(src, torch.tensor([[2, 8, 9]]))
    assert a.shape == (1, 3, 5)
    assert torch.allclose(a.sum(-1), torch.ones(1, 3), atol=1e-6)
    assert (a[..., 4] == 0).all()
    # the same weights as the attention computed by hand from the decoder states
    enc = m.encode(src)
    h, _ = m.decoder(m.tgt_embed(torch.tensor([[2, 8, 9]])), None, enc.init)
    scores = h @ m.score.W_a(enc.memory).transpose(1, 2)
    expected = torch.softmax(scores.masked_fill(src[:, None, :] == 0, float("-inf")), -1)
    assert torch.allclose(a, expected, atol=1e-6)
    with pytest.raises(ValueError, match="no attention"):
        build_model(tiny(attention="none")).attention_maps(src, torch.tensor([[2, 8]]))


def test_context_vector_model_sees_the_source_only_through_the_last_state():
    """attention = none: two sources with equal final encoder states give equal outputs."""
    torch.manual_seed(0)
    m = build_model(tiny(attention="none", bidirectional=False)).eval()
    src = torch.tensor([[5, 6, 7, 3]])
    enc = m.encode(src)
    assert enc.context.shape == (1, 16)
    assert torch.allclose(enc.context, enc.memory[:, -1], atol=1e-6)  # the last (unidirectional) state


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="'arch'"):
        tiny(arch="cnn").validate()
    with pytest.raises(ConfigError, match="'attention'"):
        tiny(attention="bilinear").validate()
    with pytest.raises(ConfigError, match="'rnn_nonlinearity'"):
        tiny(rnn_nonlinearity="sigmoid").validate()
    with pytest.raises(ConfigError, match="'input_feeding'"):
        tiny(attention="none", input_feeding=True).validate()
    tiny(n_heads=3).validate()  # heads are a Transformer setting: not checked for an LSTM

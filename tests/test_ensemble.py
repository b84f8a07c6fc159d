"""Ensemble decoding (qkv.decoding.ensemble) against references written independently.

The ensemble's next-token distribution must be the mean of its members' probabilities, computed
here with ``softmax`` and ``mean`` (the module uses ``logsumexp`` of log-probs); its beam search
must equal the reference beam search of tests/test_beam_search.py run on a naive ensemble (every
member's state copied per hypothesis, no ``expand_beams``); an ensemble of one model, or of a
model with itself, must decode exactly as the model alone. Members of different architectures
(a Transformer with an LSTM encoder-decoder) exercise the path without ``expand_beams``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from test_beam_search import V, assert_same, reference_beam_search, sources, transformer
from torch import Tensor

import qkv
from qkv.cli import main as cli_main
from qkv.config import BOS, MODEL_PRESETS, PAD, DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.data.batching import collate
from qkv.decoding import beam_search, greedy
from qkv.decoding.ensemble import Ensemble
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.training.trainer import ParallelData, train


class NaiveState:
    def __init__(self, states):
        self.states = states

    def reorder(self, indices: Tensor) -> "NaiveState":
        return NaiveState([s.reorder(indices) for s in self.states])


class NaiveEnsemble:
    """log of the mean of the members' softmax probabilities, every state a full copy per row."""

    def __init__(self, models):
        self.models = models

    def start(self, src: Tensor) -> NaiveState:
        return NaiveState([m.start(src) for m in self.models])

    def step(self, tokens: Tensor, state: NaiveState):
        probs, states = [], []
        for m, s in zip(self.models, state.states):
            logits, s = m.step(tokens, s)
            probs.append(torch.softmax(logits.double(), dim=-1))
            states.append(s)
        return torch.stack(probs).mean(dim=0).log().float(), NaiveState(states)


class Members(torch.nn.Module):
    """The test models (EndingSooner wrappers) as modules, so that Ensemble can hold them."""

    def __init__(self, wrapped):
        super().__init__()
        self.wrapped = wrapped
        self.inner = wrapped.model

    def start(self, src):
        return self.wrapped.start(src)

    def step(self, tokens, state):
        return self.wrapped.step(tokens, state)


def lstm(seed: int):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], arch="lstm", attention="general", src_vocab_size=V,
                              tgt_vocab_size=V, dropout=0.0, attention_dropout=0.0)
    model = build_model(cfg).eval()
    assert not hasattr(model.start(sources(1, 3)), "expand_beams")
    return model


@torch.inference_mode()
def test_step_is_the_mean_of_the_members_probabilities():
    a, b, c = transformer(0), transformer(1), transformer(2)
    ens = Ensemble([Members(a), Members(b), Members(c)])
    src = sources(4, 6)
    state = ens.start(src)
    states = [m.start(src) for m in (a, b, c)]
    tokens = torch.full((4,), BOS)
    for step in range(3):
        got, state = ens.step(tokens, state)
        probs = []
        for i, m in enumerate((a, b, c)):
            logits, states[i] = m.step(tokens, states[i])
            probs.append(torch.softmax(logits.double(), dim=-1))
        want = torch.stack(probs).mean(dim=0)
        torch.testing.assert_close(got.double().exp(), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(got.exp().sum(dim=-1), torch.ones(4), atol=1e-5)  # a distribution
        tokens = want.argmax(dim=-1)


@pytest.mark.parametrize("k,alpha,nbest", [(1, 0.6, 1), (3, 1.0, 2), (5, 0.6, 3)])
def test_beam_search_equals_the_reference_on_a_naive_ensemble(k, alpha, nbest):
    a, b = transformer(0), transformer(1)
    src = sources(5, 7)
    max_len = torch.tensor([4, 6, 9, 5, 7])
    got = beam_search(Ensemble([Members(a), Members(b)]), src, k, alpha, max_len, nbest)
    want = reference_beam_search(NaiveEnsemble([a, b]), src, k, alpha, max_len, nbest, 0)
    assert_same(got, want)


def test_members_of_different_architectures():
    """A Transformer and an LSTM encoder-decoder (no expand_beams): the copied-rows path."""
    a, b = transformer(0), lstm(3)
    src = sources(4, 6)
    max_len = torch.tensor([5, 7, 4, 8])
    got = beam_search(Ensemble([Members(a), b]), src, 4, 0.6, max_len, 2)
    want = reference_beam_search(NaiveEnsemble([a, b]), src, 4, 0.6, max_len, 2, 0)
    assert_same(got, want)


def test_one_model_or_a_model_twice_decodes_as_the_model():
    a = transformer(0)
    src = sources(5, 7)
    max_len = torch.tensor([4, 6, 9, 5, 7])
    alone = beam_search(a, src, 4, 0.6, max_len, 2)
    assert_same(beam_search(Ensemble([Members(a)]), src, 4, 0.6, max_len, 2), alone)
    assert_same(beam_search(Ensemble([Members(a), Members(a)]), src, 4, 0.6, max_len, 2), alone)
    assert greedy(Ensemble([Members(a), Members(a)]), src, max_len) == greedy(a, src, max_len)


def test_greedy_takes_the_argmax_of_the_mean():
    a, b = transformer(0), transformer(1)
    src = sources(5, 7)
    max_len = torch.tensor([4, 6, 9, 5, 7])
    got = greedy(Ensemble([Members(a), Members(b)]), src, max_len)
    want = reference_beam_search(NaiveEnsemble([a, b]), src, 1, 0.0, max_len, 1, 0)  # beam 1 = greedy
    assert got == [hyps[0].tokens for hyps in want]


# --- checkpoints: qkv.load_ensemble and `qkv translate --ensemble` ----------------------------------

def _train(out, pairs, d_model=32, seed=0):
    data = ParallelData([s for s, _ in pairs], [t for _, t in pairs], name="numbers")
    model = ModelConfig(d_model=d_model, n_heads=2, d_ff=2 * d_model, n_encoder_layers=1, n_decoder_layers=1,
                        max_positions=64)
    cfg = TrainConfig(tokenizer="char", vocab_size=60, max_tokens=512, warmup_steps=10, max_steps=4,
                      eval_every=4, eval_bleu_samples=0, seed=seed)
    train(model, cfg, DecodeConfig(beam_size=3), data, None, out, log=lambda m: None)
    return out / "last"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("ensemble")
    pairs = [(toy.english(n), toy.german(n)) for n in range(1, 300, 3)]
    other = [(s.upper(), t.upper()) for s, t in pairs]  # other characters: another tokenizer
    return {"a": _train(d / "a", pairs, seed=0), "b": _train(d / "b", pairs, d_model=16, seed=1),
            "other": _train(d / "other", other, seed=0)}


def test_load_ensemble_decodes_as_the_mean(runs):
    ens = qkv.load_ensemble([runs["a"], runs["b"]])
    a, b = qkv.load(runs["a"]), qkv.load(runs["b"])
    assert ens.decode_cfg == a.decode_cfg  # the first member's settings
    src = ["five", "twelve", "three hundred"]
    got = ens.translate_scored(src, beam_size=3, length_penalty=0.6)
    batch = collate(a.tokenizers.src.encode(src), None).src  # each source ends in EOS
    max_len = (batch != PAD).sum(dim=1) + 50  # the decoding config's default: |x| + 50
    # beam_search itself is checked against the reference above; the naive ensemble is the independent part
    want = beam_search(NaiveEnsemble([a.model, b.model]), batch, 3, 0.6, max_len, 1)
    assert [t for t, _ in (hyps[0] for hyps in got)] == a.tokenizers.tgt.decode([h[0].tokens for h in want])
    for (_, score), hyps in zip((h[0] for h in got), want):
        assert score == pytest.approx(hyps[0].score, rel=1e-5, abs=1e-5)


def test_load_ensemble_refuses_another_vocabulary(runs):
    with pytest.raises(QkvError, match=r"other.*tokenizer differs"):
        qkv.load_ensemble([runs["a"], runs["other"]])
    with pytest.raises(QkvError, match="at least one"):
        qkv.load_ensemble([])


def test_cli_translate_with_ensemble(runs, capsys):
    assert cli_main(["translate", str(runs["a"]), "--ensemble", str(runs["b"]), "five", "twelve"]) == 0
    got = capsys.readouterr().out.splitlines()
    assert got == qkv.load_ensemble([runs["a"], runs["b"]]).translate(["five", "twelve"])


def test_cli_ensemble_errors_name_the_checkpoint(runs, capsys, tmp_path):
    assert cli_main(["translate", str(runs["a"]), "--ensemble", str(runs["other"]), "five"]) != 0
    err = capsys.readouterr().err
    assert str(runs["other"]) in err and "tokenizer differs" in err
    classifier = shutil.copytree(runs["b"], tmp_path / "clf")
    config = json.loads((classifier / "config.json").read_text())
    config["model"]["task"] = "classify"
    (classifier / "config.json").write_text(json.dumps(config))
    assert cli_main(["translate", str(runs["a"]), "--ensemble", str(classifier), "five"]) != 0
    err = capsys.readouterr().err
    assert str(classifier) in err and "not a translation model" in err
    assert cli_main(["translate", str(runs["a"]), "--ensemble", str(tmp_path / "missing"), "five"]) != 0
    assert "missing" in capsys.readouterr().err
    assert cli_main(["evaluate", str(runs["a"]), "--ensemble", str(runs["b"]), "--test", str(tmp_path / "t")]) != 0
    assert "not for --test" in capsys.readouterr().err
    (tmp_path / "h").write_text("fünf\n", encoding="utf-8")
    assert cli_main(["evaluate", "--hyp", str(tmp_path / "h"), "--ref", str(tmp_path / "h"),
                     "--ensemble", str(runs["b"])]) != 0
    assert "give a MODEL with --src" in capsys.readouterr().err

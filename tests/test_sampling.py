"""Sampling: the filters against hand-computed sets, greedy at temperature 0, seeded reproducibility."""

import dataclasses
import math

import pytest
import torch

from qkv.config import BOS, EOS, MODEL_PRESETS, PAD, UNK
from qkv.decoding.sampling import apply_temperature, next_token, sample, top_k_filter, top_p_filter
from qkv.errors import ConfigError
from qkv.models.decoder_only import DecoderOnlyTransformer
from qkv.models.rnn_lm import RNNLanguageModel


def kept(logits):
    return set(torch.isfinite(logits).nonzero()[:, -1].tolist())


def test_top_k_keeps_exactly_k_candidates_even_with_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 3.0, 0.0]])
    assert kept(top_k_filter(logits, 1)) == {1}
    out = top_k_filter(logits, 3)
    assert len(kept(out)) == 3 and 1 in kept(out)  # 5.0 and two of the three tied 3.0s
    assert kept(top_k_filter(logits, 0)) == set(range(6))  # 0: no filter
    assert torch.equal(out[torch.isfinite(out)].sort().values, torch.tensor([3.0, 3.0, 5.0]))


def test_top_p_keeps_the_smallest_set_with_mass_at_least_p():
    probs = torch.tensor([[0.05, 0.5, 0.2, 0.25]])
    logits = probs.log()
    assert kept(top_p_filter(logits, 0.5)) == {1}  # 0.5 >= 0.5 already
    assert kept(top_p_filter(logits, 0.6)) == {1, 3}  # 0.75
    assert kept(top_p_filter(logits, 0.75)) == {1, 3}  # exactly 0.75 suffices
    assert kept(top_p_filter(logits, 0.76)) == {1, 3, 2}  # 0.95
    assert kept(top_p_filter(logits, 0.96)) == {0, 1, 2, 3}
    assert kept(top_p_filter(logits, 0.01)) == {1}  # the most probable is always kept
    with pytest.raises(ConfigError, match="top_p"):
        top_p_filter(logits, 0.0)


def test_temperature_divides_logits_and_filtered_draws_stay_in_the_set():
    z = torch.tensor([[2.0, 4.0]])
    assert torch.equal(apply_temperature(z, 2.0), torch.tensor([[1.0, 2.0]]))
    g = torch.Generator().manual_seed(0)
    for seed in (0, 5, 8):  # seeds 5 and 8 put PAD or BOS among the raw top 5
        logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(seed))
        masked = logits.clone()
        masked[:, [PAD, UNK, BOS]] = -math.inf  # never drawn, so the top 5 are taken among the others
        allowed = kept(top_k_filter(masked, 5))
        draws = {int(next_token(logits, 1.0, top_k=5, generator=g)) for _ in range(200)}
        assert draws <= allowed and len(draws) > 1


def test_draw_frequencies_follow_the_renormalised_distribution():
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.1, 0.6, 0.3]])  # PAD/UNK/BOS impossible
    logits = probs.clamp_min(1e-30).log()
    g = torch.Generator().manual_seed(1)
    n = 4000
    tokens = next_token(logits.expand(n, -1), 1.0, top_p=0.8, generator=g)  # keeps {4, 5}: 0.6 + 0.3
    freq4 = (tokens == 4).float().mean().item()
    assert set(tokens.tolist()) == {4, 5}
    assert abs(freq4 - 0.6 / 0.9) < 0.03


def lm(kind):
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=20, tgt_vocab_size=20)
    return (DecoderOnlyTransformer(cfg) if kind == "transformer" else RNNLanguageModel(cfg, kind=kind)).eval()


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_temperature_zero_equals_greedy_recomputation(kind):
    m = lm(kind)
    prefix = [5, 6, 7]
    out = list(sample(m, prefix, max_new_tokens=8, temperature=0))
    seq = list(prefix)  # greedy by recomputing the whole sequence every step (no cache)
    for _ in range(8):
        logits = m(torch.tensor([seq]))
        logits = logits[0] if isinstance(logits, tuple) else logits
        z = logits[0, -1].clone()
        z[[PAD, UNK, BOS]] = -math.inf
        seq.append(int(z.argmax()))
    assert out == seq[3:]


def test_seeded_sampling_is_reproducible_and_streams():
    m = lm("transformer")
    a = list(sample(m, [5, 6], max_new_tokens=20, temperature=1.5, seed=3))
    b = list(sample(m, [5, 6], max_new_tokens=20, temperature=1.5, seed=3))
    c = list(sample(m, [5, 6], max_new_tokens=20, temperature=1.5, seed=4))
    assert a == b and a != c and len(a) == 20
    gen = sample(m, [], max_new_tokens=3, seed=0)  # a generator: tokens come one at a time
    assert isinstance(next(gen), int)


def test_stop_at_eos():
    m = lm("gru")
    with torch.no_grad():
        m.output_bias[EOS] = 100.0  # EOS always wins
    assert list(sample(m, [5], max_new_tokens=5, temperature=0, stop_at_eos=True)) == []
    assert list(sample(m, [5], max_new_tokens=2, temperature=0)) == [EOS, EOS]


def test_top_p_below_float32_keeps_the_most_probable_token():
    """A p that rounds to 0 in float32 still keeps the most probable token (never a row of -inf)."""
    import math

    import torch

    from qkv.decoding.sampling import top_p_filter

    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    out = top_p_filter(logits, 1e-300)
    assert out[0, 1] == 2.0 and all(out[0, i] == -math.inf for i in (0, 2, 3))


def test_a_temperature_that_overflows_float32_is_refused_by_name():
    """Dividing float32 logits by a temperature below MIN_TEMPERATURE gives inf, and sampling NaN."""
    import pytest
    import torch

    from qkv.decoding.sampling import MIN_TEMPERATURE, next_token
    from qkv.errors import ConfigError

    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 0.3]])
    with pytest.raises(ConfigError, match="at least"):
        next_token(logits, temperature=1e-40)
    assert next_token(logits, temperature=MIN_TEMPERATURE).shape == (1,)

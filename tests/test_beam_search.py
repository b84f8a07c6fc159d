"""Batched beam search on real models against a straightforward reference; every decoding mode
(greedy, beam with n-best, a forced target prefix, sampling with a seed, an ensemble) of the
incremental Transformer against the same model recomputed in full at every step (:class:`FullRecompute`).

The batched search (qkv.decoding.beam_search) keeps the Transformer's cross-attention keys/values
once per sentence (TransformerState.expand_beams / reorder with beam > 1) and never builds the
(N, k*V) table of every extension (top tokens per row first). The reference below does neither:
every hypothesis row gets its own copy of the source side (``reorder(repeat_interleave)``), the
log-probs go through greedy's ``log_probs`` + ``force_eos`` over the whole vocabulary, and each
sentence picks its top 2k of the full k x V table, in a plain Python loop over sentences; done
sentences are not dropped from the batch. Same algorithm (module docstring of beam_search), none
of the shortcuts. With ``early_stopping`` the reference follows fairseq's ``SequenceGenerator``
as written there: a sentence accepts finished hypotheses first come, first served, until it has
``k``, and is done the step it has them (qkv keeps the ``k`` best instead, which must come to the
same); ``length_norm="length"`` divides by ``|Y| ** alpha`` (fairseq's ``--lenpen``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from qkv.config import BOS, EOS, MODEL_PRESETS, PAD
from qkv.decoding import Hypothesis, beam_search
from qkv.decoding.beam_search import length_penalty
from qkv.decoding.greedy import force_eos, log_probs
from qkv.models import build_model
from qkv.models.transformer import TransformerState

V = 12  # small vocabulary: EOS is likely enough that sentences end at different steps


@torch.inference_mode()
def reference_beam_search(model, src: Tensor, k: int, alpha: float, max_len: Tensor, nbest: int, min_len: int,
                          length_norm: str = "gnmt", early_stopping: bool = False):
    """Beam search written out: full log-prob table, one sentence at a time, no shortcuts."""
    b = src.size(0)
    state = model.start(src).reorder(torch.arange(b).repeat_interleave(k))  # every row its own copy
    scores = [[0.0] + [-math.inf] * (k - 1) for _ in range(b)]
    prefixes = [[[] for _ in range(k)] for _ in range(b)]
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    searching = [True] * b
    tokens = torch.full((b * k,), BOS)
    for step in range(int(max_len.max()) + 1):
        logits, state = model.step(tokens, state)
        at_limit = (max_len <= step).repeat_interleave(k)
        logp = force_eos(log_probs(logits), at_limit, before_min_len=step < min_len).view(b, k, -1)  # (B, k, V)
        rows, next_tokens = torch.arange(b * k), torch.full((b * k,), EOS)
        for i in range(b):
            if not searching[i]:
                continue
            table = torch.tensor(scores[i]).unsqueeze(1) + logp[i]  # (k, V): every extension
            top, idx = table.view(-1).topk(2 * k)
            cands = [(float(s), int(j) // V, int(j) % V) for s, j in zip(top, idx)]  # (score, beam, token)
            lp = length_penalty(step + 1, alpha) if length_norm == "gnmt" else (step + 1) ** alpha
            for s, j, v in cands[:k]:  # EOS within the top k: a finished hypothesis
                if v == EOS and math.isfinite(s):
                    if early_stopping:  # fairseq: the first k to finish, in candidate order
                        if len(finished[i]) < k:
                            finished[i].append(Hypothesis(prefixes[i][j], s / lp, s))
                        continue
                    finished[i].append(Hypothesis(prefixes[i][j], s / lp, s))
                    finished[i].sort(key=lambda h: h.score, reverse=True)
                    del finished[i][k:]
            live = [c for c in cands if c[2] != EOS][:k]
            worst = finished[i][-1].score if len(finished[i]) == k else -math.inf
            full = len(finished[i]) == k if early_stopping else live[0][0] / lp <= worst
            if full or max_len[i] <= step or not math.isfinite(live[0][0]):
                searching[i] = False
                continue
            scores[i] = [s for s, _, _ in live]
            prefixes[i] = [prefixes[i][j] + [v] for _, j, v in live]
            rows[i * k:(i + 1) * k] = torch.tensor([i * k + j for _, j, _ in live])
            next_tokens[i * k:(i + 1) * k] = torch.tensor([v for _, _, v in live])
        if not any(searching):
            break
        state, tokens = state.reorder(rows), next_tokens
    return [sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest] for hyps in finished]


class EndingSooner:
    """A model whose EOS logit grows by ``rate`` per decoded position, so that random-weight
    models end their sentences at different steps (the state is the model's own)."""

    def __init__(self, model, rate: float = 0.7):
        self.model, self.rate = model, rate

    def start(self, src: Tensor):
        return self.model.start(src)

    def step(self, tokens: Tensor, state):
        logits, state = self.model.step(tokens, state)
        logits[:, EOS] += self.rate * state.position
        return logits, state


def transformer(seed: int = 0, **kw) -> EndingSooner:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=V, tgt_vocab_size=V, dropout=0.0,
                              attention_dropout=0.0, **kw)
    return EndingSooner(build_model(cfg).eval())


def sources(b: int, s: int, seed: int = 1) -> Tensor:
    """Random sources of different lengths (padded), each ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (b, s), generator=g)
    for i in range(b):
        n = 2 + (i * 3) % (s - 1)  # lengths 2 .. s
        src[i, n - 1] = EOS
        src[i, n:] = PAD
    return src


def assert_same(got: list[list[Hypothesis]], want: list[list[Hypothesis]]):
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    for hs, ws in zip(got, want):
        for h, w in zip(hs, ws):
            assert h.score == pytest.approx(w.score, rel=1e-5, abs=1e-5)
            assert h.logprob == pytest.approx(w.logprob, rel=1e-5, abs=1e-5)


CASES = [  # beam, alpha, min_len, nbest
    (1, 0.6, 0, 1),
    (2, 0.0, 0, 2),
    (3, 0.6, 2, 3),
    (5, 1.0, 0, 3),
    (5, 0.6, 3, 1),
]


@pytest.mark.parametrize("k,alpha,min_len,nbest", CASES)
def test_transformer_beam_search_equals_reference(k, alpha, min_len, nbest):
    model = transformer()
    src = sources(7, 6)
    max_len = torch.tensor([1, 3, 4, 5, 6, 7, 8])  # per sentence, one below some min_len
    got = beam_search(model, src, k, alpha, max_len, nbest=nbest, min_len=min_len)
    want = reference_beam_search(model, src, k, alpha, max_len, nbest, min_len)
    assert_same(got, want)
    assert all(len(h) == nbest or len(h) == len(w) for h, w in zip(got, want))
    lengths = {len(h.tokens) for hs in got for h in hs}
    assert len(lengths) >= 3, f"the case should have hypotheses of several lengths, got {lengths}"
    ended_early = [len(hs[0].tokens) < int(m) for hs, m in zip(got, max_len)]
    assert any(ended_early) and not all(ended_early), "some sentences should end before their limit, some not"
    assert all(len(h.tokens) >= min(min_len, int(m)) for hs, m in zip(got, max_len) for h in hs)


@pytest.mark.parametrize("k,alpha,length_norm,early_stopping", [
    (3, 1.0, "length", True),  # fairseq's decoding (--lenpen 1)
    (5, 1.0, "length", True),
    (5, 0.6, "gnmt", True),
    (4, 1.0, "length", False),
    (5, 2.0, "length", False),
])
def test_fairseq_length_norm_and_early_stopping_equal_reference(k, alpha, length_norm, early_stopping):
    model = transformer()
    src = sources(7, 6)
    max_len = torch.tensor([1, 3, 4, 5, 6, 7, 8])
    got = beam_search(model, src, k, alpha, max_len, nbest=k, length_norm=length_norm,
                      early_stopping=early_stopping)
    want = reference_beam_search(model, src, k, alpha, max_len, k, 0, length_norm, early_stopping)
    assert_same(got, want)
    for hs in got:
        for h in hs:
            n = len(h.tokens) + 1  # EOS counted
            lp = n ** alpha if length_norm == "length" else ((5 + n) / 6) ** alpha
            assert h.score == pytest.approx(h.logprob / lp, rel=1e-5, abs=1e-5)
    if early_stopping:  # the case is one where the rule matters: without it other hypotheses are found
        bound = beam_search(model, src, k, alpha, max_len, nbest=k, length_norm=length_norm)
        assert [[h.tokens for h in hs] for hs in got] != [[h.tokens for h in hs] for hs in bound]


def test_transformer_beam_search_keeps_finished_sentences_the_same():
    model = transformer(seed=3, norm_first=True)
    src = sources(5, 7, seed=2)
    max_len = torch.tensor([9, 2, 6, 4, 7])
    want = reference_beam_search(model, src, 4, 0.6, max_len, 4, 1)
    for drop in (True, False):
        assert_same(beam_search(model, src, 4, 0.6, max_len, nbest=4, min_len=1, drop_finished=drop), want)


@pytest.mark.parametrize("kw", [{"attention": "additive"}, {"attention": "general", "input_feeding": True}])
def test_rnn_seq2seq_beam_search_equals_reference(kw):
    """States without ``expand_beams`` (here the RNN encoder-decoder) still get k copies of each row."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], arch="lstm", d_model=16, n_encoder_layers=2,
                              n_decoder_layers=2, dropout=0.0, src_vocab_size=V, tgt_vocab_size=V, **kw)
    model = build_model(cfg).eval()
    src = sources(6, 6, seed=4)
    max_len = torch.tensor([2, 4, 5, 6, 7, 8])
    assert not hasattr(model.start(src), "expand_beams")
    got = beam_search(model, src, 5, 0.6, max_len, nbest=5, min_len=1)
    assert_same(got, reference_beam_search(model, src, 5, 0.6, max_len, 5, 1))


def test_transformer_state_with_beams_steps_like_one_row_per_hypothesis():
    """expand_beams + reorder by sentence give the logits of the layout with every row's own copy."""
    model = transformer(seed=5).model
    src = sources(4, 6, seed=6)
    k = 3
    with torch.inference_mode():
        start = model.start(src)
        grouped = start.expand_beams(k)  # cross K/V (4, h, S, d_k)
        per_row = start.reorder(torch.arange(4).repeat_interleave(k))  # cross K/V (12, h, S, d_k)
        assert grouped.beam == k and grouped.cross_kv[0].k.size(0) == 4 and per_row.cross_kv[0].k.size(0) == 12
        g = torch.Generator().manual_seed(0)
        tokens = torch.full((4 * k,), BOS)
        sents = torch.arange(4)
        for t in range(5):
            logits_g, grouped = model.step(tokens, grouped)
            logits_r, per_row = model.step(tokens, per_row)
            torch.testing.assert_close(logits_g, logits_r, rtol=1e-5, atol=1e-5)
            n = sents.numel()
            keep = torch.arange(n) if t % 2 == 0 else torch.tensor([i for i in range(n) if i != 1])  # drop one
            back = torch.randint(0, k, (keep.numel(), k), generator=g)  # back-pointers within a sentence
            rows = (keep.unsqueeze(1) * k + back).view(-1)
            old_cross = grouped.cross_kv[0].k
            grouped, per_row = grouped.reorder(rows), per_row.reorder(rows)
            if keep.numel() == n:  # same sentences: the per-sentence keys/values are not copied
                assert grouped.cross_kv[0].k is old_cross
            else:
                assert grouped.cross_kv[0].k.size(0) == keep.numel()
            sents = sents[keep]
            tokens = torch.randint(4, V, (rows.numel(),), generator=g)
        torch.testing.assert_close(grouped.memory_mask, per_row.memory_mask[::k])
        for a, b in zip(grouped.self_kv, per_row.self_kv):
            torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-5)


def test_reorder_with_beams_rejects_rows_that_mix_sentences():
    model = transformer().model
    state = model.start(sources(2, 5)).expand_beams(2)  # rows 0,1: sentence 0; rows 2,3: sentence 1
    assert isinstance(state, TransformerState)
    state.reorder(torch.tensor([1, 1, 2, 3]))
    with pytest.raises(AssertionError, match="one sentence"):
        state.reorder(torch.tensor([1, 2, 2, 3]))


# --- every decoding mode against the full, non-incremental forward -------------------------------------

@dataclasses.dataclass
class PrefixState:
    """The state of :class:`FullRecompute`: the encoder output, its mask and every row's whole prefix."""

    memory: Tensor  # (B, S, d)
    mask: Tensor  # (B, 1, 1, S)
    prefix: Tensor  # (B, t + 1): BOS and the tokens fed so far

    @property
    def position(self) -> int:  # target positions decoded so far, as TransformerState counts them
        return self.prefix.size(1)

    def reorder(self, indices: Tensor) -> "PrefixState":
        return PrefixState(self.memory[indices], self.mask[indices], self.prefix[indices])


class FullRecompute(torch.nn.Module):
    """A Transformer decoded without its incremental state: every step runs the decoder's full,
    teacher-forced forward over the row's whole prefix (no key/value cache, no per-sentence
    cross-attention keys/values, no eval-mode step) and returns the last position's logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def max_source_len(self):
        return self.model.max_source_len()

    def max_steps(self, src_lengths):
        return self.model.max_steps(src_lengths)

    def start(self, src: Tensor) -> PrefixState:
        memory, mask, _ = self.model.encode(src)
        return PrefixState(memory, mask, src.new_empty(src.size(0), 0))

    def step(self, tokens: Tensor, state: PrefixState):
        prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)  # (B, t + 1)
        logits, _ = self.model.decode(prefix, state.memory, state.mask)  # (B, t + 1, V)
        return logits[:, -1], PrefixState(state.memory, state.mask, prefix)


def both(seed: int = 0, **kw) -> tuple[EndingSooner, EndingSooner]:
    """A random-weight Transformer whose sentences end at different steps, decoded incrementally and
    by full recomputation."""
    lean = transformer(seed, **kw)
    return lean, EndingSooner(FullRecompute(lean.model), lean.rate)


@pytest.mark.parametrize("kw", [{}, {"norm_first": True}, {"positional": "learned"}])
def test_greedy_equals_full_recomputation(kw):
    lean, full = both(**kw)
    src = sources(7, 6)
    max_len = torch.tensor([1, 3, 4, 5, 6, 7, 8])
    from qkv.decoding import greedy

    got, want = greedy(lean, src, max_len, min_len=1), greedy(full, src, max_len, min_len=1)
    assert got == want
    assert len({len(t) for t in got}) >= 3  # sentences ended at different steps


@pytest.mark.parametrize("k,alpha,min_len,nbest", CASES)
def test_beam_search_nbest_equals_full_recomputation(k, alpha, min_len, nbest):
    lean, full = both(seed=2, norm_first=True)
    src = sources(7, 6, seed=3)
    max_len = torch.tensor([1, 3, 4, 5, 6, 7, 8])
    got = beam_search(lean, src, k, alpha, max_len, nbest=nbest, min_len=min_len)
    assert_same(got, beam_search(full, src, k, alpha, max_len, nbest=nbest, min_len=min_len))
    assert len({len(h.tokens) for hs in got for h in hs}) >= 3


def test_ensemble_equals_full_recomputation():
    from qkv.decoding.ensemble import Ensemble

    (a, fa), (b, fb) = both(seed=4), both(seed=5)
    src = sources(5, 6, seed=6)
    max_len = torch.tensor([2, 4, 5, 6, 7])
    got = beam_search(Ensemble([a.model, b.model]).eval(), src, 4, 0.6, max_len, nbest=2)
    want = beam_search(Ensemble([fa.model, fb.model]).eval(), src, 4, 0.6, max_len, nbest=2)
    assert_same(got, want)


def test_sampling_with_a_seed_equals_full_recomputation():
    """Tokens drawn with one seed from the incremental step's distribution and from the full forward's."""
    from qkv.decoding.sampling import next_token

    lean, full = both(seed=7)
    src = sources(4, 6, seed=8)
    drawn = []
    for model in (lean, full):
        g = torch.Generator().manual_seed(0)
        state, tokens, out = model.start(src), torch.full((4,), BOS), []
        with torch.inference_mode():
            for _ in range(6):
                logits, state = model.step(tokens, state)
                tokens = next_token(logits, temperature=1.0, top_k=5, generator=g)
                out.append(tokens)
        drawn.append(torch.stack(out, 1))
    assert torch.equal(drawn[0], drawn[1])


@pytest.mark.parametrize("beam,nbest,prefix", [(1, 1, ""), (5, 3, ""), (1, 1, "blue"), (4, 2, "red")])
def test_fixture_checkpoint_decodes_as_full_recomputation(beam, nbest, prefix):
    """``qkv translate``'s decoding of the fixture checkpoint (greedy, beam with n-best, a forced
    target prefix) through the lean incremental step and through full recomputation."""
    from pathlib import Path

    import qkv

    translator = qkv.load(Path(__file__).parent / "fixtures" / "checkpoints" / "translate-transformer")
    sentences = ["red cat", "the big dog sun", "small tree", "a sun", "blue blue dog cat red"]
    limits = {"max_len_a": 0.0, "max_len_b": 12}  # the fixture model seldom ends a sentence
    lean = translator.hypotheses(sentences, target_prefix=prefix or None, beam_size=beam, nbest=nbest, **limits)
    model = translator.model
    try:
        translator.model = FullRecompute(model)
        full = translator.hypotheses(sentences, target_prefix=prefix or None, beam_size=beam, nbest=nbest, **limits)
    finally:
        translator.model = model
    assert_same(lean, full)
    assert all(len(hs) == nbest for hs in lean)

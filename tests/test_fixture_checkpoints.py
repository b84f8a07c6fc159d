"""Checkpoints written by an earlier qkv still load and give the same outputs.

tests/fixtures/checkpoints/ holds tiny checkpoints of every task (made by
tests/fixtures/make_checkpoints.py at the commit in MADE_AT) and what they produced then.
"""

import json
import math
from pathlib import Path

import pytest
import torch

import qkv
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
RECORDED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
SOURCES, EXPECTED = RECORDED["sources"], RECORDED["outputs"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_an_old_checkpoint_loads_and_gives_its_recorded_outputs(name):
    model = qkv.load(FIXTURES / name)
    want = EXPECTED[name]
    if "greedy" in want:
        assert model.translate(SOURCES, beam_size=1) == want["greedy"]
        got = model.translate_scored(SOURCES, beam_size=4, nbest=2)
        assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in hyps] for hyps in want["beam4"]]
        for hyps, ref in zip(got, want["beam4"]):  # log-probabilities: every weight counts
            assert [s for _, s in hyps] == pytest.approx([s for _, s in ref], rel=1e-5, abs=1e-6)
    if "probabilities" in want:
        torch.testing.assert_close(model.probabilities(SOURCES), torch.tensor(want["probabilities"]),
                                   rtol=0, atol=1e-6)
    if "embed" in want:
        torch.testing.assert_close(model.embed(SOURCES), torch.tensor(want["embed"]), rtol=0, atol=1e-6)
    if "generate" in want:
        assert "".join(model.generate("red", max_new_tokens=12, temperature=0.0)) == want["generate"]
        assert math.isclose(model.score(SOURCES).ppl, want["ppl"], rel_tol=1e-6)

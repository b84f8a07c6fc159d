import re
from pathlib import Path

import torch

from qkv.masks import (
    causal_mask, combine, key_padding_mask, length_mask, padding_mask, prefix_mask, real_tokens,
)


def test_padding_mask_hides_pad_keys():
    tokens = torch.tensor([[5, 6, 3, 0], [7, 3, 0, 0]])
    m = padding_mask(tokens)
    assert m.shape == (2, 1, 1, 4)
    assert m[0, 0, 0].tolist() == [True, True, True, False]
    assert m[1, 0, 0].tolist() == [True, True, False, False]


def test_causal_mask_is_lower_triangular():
    m = causal_mask(3)
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_causal_mask_for_the_last_queries_of_a_longer_sequence():
    # 2 new queries at positions 2 and 3 of a 4-long sequence
    assert causal_mask(2, 4)[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_combine_is_logical_and_with_broadcasting():
    pad = padding_mask(torch.tensor([[4, 3, 0]]))
    m = combine(pad, None, causal_mask(3))
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert combine(None, None) is None


def test_real_tokens_key_padding_and_length_masks():
    tokens = torch.tensor([[5, 6, 3, 0], [7, 3, 0, 0]])
    real = real_tokens(tokens)
    assert real.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert key_padding_mask(real).equal(padding_mask(tokens))
    assert length_mask(real.sum(dim=1), 4).equal(real)  # right padding: the real tokens are a prefix


def test_prefix_mask_is_causal_without_padding_keys_and_never_empty():
    tokens = torch.tensor([[5, 6, 7], [8, 0, 0]])
    m = prefix_mask(tokens)
    assert m.shape == (2, 1, 3, 3)
    assert m[0, 0].equal(causal_mask(3)[0, 0])
    # row 2: the real token sees itself; padded queries see the real key and themselves only
    assert m[1, 0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]


def test_masks_are_built_only_in_masks_py():
    """No padding comparison or triangular/identity mask is built in the model layer: masks.py
    says which tokens are real and which keys a query may see."""
    src = Path(__file__).resolve().parents[1] / "src" / "qkv"
    built_here = re.compile(r"\.(tril|triu)\(|torch\.(tril|triu|eye)\("  # triangular and identity masks
                            r"|[!=]= ?PAD\b|\b(tokens|src|tgt|prefix)\w* ?[!=]= ?0\b")  # padding comparisons
    files = [p for d in ("nn", "models", "decoding") for p in (src / d).glob("*.py")]
    files += [src / "long_range.py", src / "complexity.py"]
    found = [f"{p.relative_to(src)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if built_here.search(line)]
    assert not found, "build these masks in qkv/masks.py:\n" + "\n".join(found)

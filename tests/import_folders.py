"""What the import tests share once a folder is imported: qkv serve's app over checkpoints (in process, its
client on 127.0.0.1, no socket left open) and transformers' own attention weights, to hold qkv's attention
maps (``qkv viz attention``'s data) against."""

from __future__ import annotations

import pytest
import torch


def served(*models):
    """A fastapi TestClient (a context manager) of ``qkv serve``'s app over ``models`` (paths or name=path)."""
    pytest.importorskip("fastapi", reason='qkv serve needs fastapi: pip install -c constraints.txt -e ".[serve]"')
    pytest.importorskip("httpx", reason='the serve tests need httpx: pip install -c constraints.txt -e ".[serve]"')
    from fastapi.testclient import TestClient

    from qkv.serve.app import create_app
    from qkv.serve.limits import Limits
    from qkv.serve.service import load_models

    limits = Limits()
    return TestClient(create_app(load_models([str(m) for m in models], limits), limits), base_url="http://127.0.0.1")


def padded_logits(lm, hf, ids: list[list[int]]):
    """qkv's language model ``lm`` and transformers' ``hf`` on the right-padded batch of ``ids`` (qkv's ids, as
    qkv's batches are): ``(got, want, real, have)``, both logits in qkv's vocabulary order, ``real`` the
    positions that are not padding, ``have`` the rows that are the model's own tokens (not rows qkv adds)."""
    from qkv.config import PAD

    width = max(map(len, ids))
    tokens = torch.tensor([x + [PAD] * (width - len(x)) for x in ids])
    real = tokens != PAD
    model_ids = torch.tensor([m if m is not None else 0 for m in lm.tokenizer.ids.model_ids])
    have = torch.tensor([m is not None for m in lm.tokenizer.ids.model_ids])
    with torch.inference_mode():
        want = hf(input_ids=model_ids[tokens], attention_mask=real.long()).logits[..., model_ids]
        got = lm.model(tokens)
    return got, want, real, have


def eager(model):
    """``model`` computing attention with transformers' eager implementation (the one that returns weights)."""
    model.set_attn_implementation("eager")
    return model


def max_map_difference(got: list, want) -> float:
    """The largest difference between qkv's maps ``got`` ([layer][head][query][key], as ``attention_data`` gives
    them) and transformers' ``want`` (per layer (1, heads, queries, keys)); their shapes must agree."""
    got = torch.tensor(got)
    want = torch.stack([w[0] for w in want])
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    return float((got - want).abs().max())


def rows_sum_to_one(maps: list) -> bool:
    rows = torch.tensor(maps).sum(-1)
    return bool(torch.allclose(rows, torch.ones_like(rows), atol=1e-5))

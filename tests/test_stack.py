"""One Transformer stack for the three Transformers (qkv.nn.stack)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.config import MODEL_PRESETS, PAD
from qkv.masks import causal_mask, padding_mask
from qkv.models import build_model
from qkv.nn.layers import EncoderLayer
from qkv.nn.positional import sinusoidal_table
from qkv.nn.stack import TransformerStack

V = 30


def tiny(task: str, **kw):
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], task=task, src_vocab_size=V, tgt_vocab_size=V, n_classes=3,
                              max_positions=32, **kw)
    return build_model(cfg).eval()


# Checkpoints name the parameters, and saved optimizer states follow their order: both are those of
# the models as first written, whatever the stack they now run through.
LAYOUT = {
    "translate": ["src_embed", "tgt_embed", "output_proj", "src_pos", "tgt_pos", "encoder_layers", "decoder_layers",
                  "encoder_norm", "decoder_norm"],
    "classify": ["src_embed", "src_pos", "encoder_layers", "encoder_norm", "classifier"],
    "mlm": ["src_embed", "src_pos", "encoder_layers", "encoder_norm", "mlm_head"],
    "lm": ["embed", "output_proj", "pos", "layers", "final_norm"],
    "prefix_lm": ["embed", "output_proj", "pos", "layers", "final_norm"],
}


@pytest.mark.parametrize("task", sorted(LAYOUT))
def test_parameter_names_and_order_are_those_of_every_checkpoint(task):
    kw = {"share_embeddings": False} if task == "translate" else {}
    m = tiny(task, positional="learned", norm_first=True, tie_output=False, **kw)
    names = [n for n, _ in m.named_parameters()]
    assert list(dict.fromkeys(n.split(".")[0] for n in names)) == LAYOUT[task]
    assert [k for k in m.state_dict() if k != "mlm_head.embed.weight"] == names  # (the MLM head's is tied)
    layers = "layers" if task in ("lm", "prefix_lm") else "encoder_layers"
    assert f"{layers}.1.ffn.w_1.weight" in names and f"{layers}.0.res_attn.norm.bias" in names
    if task == "translate":
        assert "decoder_layers.1.cross_attn.in_proj.weight" in names and "decoder_layers.0.res_cross.norm.weight" in names


def test_a_stack_is_scaled_embedding_plus_positions_then_the_layers_then_the_norm():
    m = tiny("classify", norm_first=True)
    tokens = torch.tensor([[4, 7, 8, 9], [4, 5, PAD, PAD]])
    mask = padding_mask(tokens)
    x = m.src_embed.weight[tokens] * math.sqrt(32) + sinusoidal_table(4, 32)  # (B, T, d)
    for layer in m.encoder_layers:
        x, _, _ = layer(x, mask)
    expected = F.layer_norm(x, (32,), m.encoder_norm.weight, m.encoder_norm.bias)
    h, caches, weights = m.encoder(tokens, mask=mask)
    torch.testing.assert_close(h, expected)
    assert caches is None and weights == [None, None]
    assert isinstance(m.encoder, TransformerStack) and m.encoder.layers is m.encoder_layers


def test_inputs_at_per_row_positions_equal_inputs_at_an_offset():
    for positional in ("sinusoidal", "learned"):
        stack = tiny("lm", positional=positional).decoder
        tokens = torch.randint(4, V, (3, 5))
        at = torch.arange(2, 7).expand(3, 5)  # (B, T) positions 2..6 in every row
        torch.testing.assert_close(stack.inputs(tokens, at), stack.inputs(tokens, 2), rtol=0, atol=0)


def test_input_dropout_follows_the_models_mode():
    m = tiny("classify", dropout=0.5)
    tokens = torch.randint(4, V, (2, 6))
    assert torch.equal(m.encoder.inputs(tokens), m.encoder.inputs(tokens))  # eval: no dropout
    m.train()
    dropped = m.encoder.inputs(tokens)
    assert (dropped == 0).any() and not torch.equal(dropped, m.encoder.inputs(tokens))


def test_the_decoder_only_model_is_an_encoder_stack_run_with_the_causal_mask():
    m = tiny("lm", norm_first=True)
    assert all(type(layer) is EncoderLayer for layer in m.layers)
    tokens = torch.randint(4, V, (2, 7))
    h, _, _ = m.decoder(tokens, mask=causal_mask(7))
    torch.testing.assert_close(m(tokens, features=True), h, atol=1e-6, rtol=1e-6)


def test_a_stack_with_caches_decodes_as_the_whole_sequence():
    m = tiny("translate", norm_first=True)
    src, tgt = torch.randint(4, V, (2, 5)), torch.randint(4, V, (2, 4))
    memory, mask, _ = m.encode(src)
    whole, _, _ = m.decoder(tgt, memory_kv=m.memory_kv(memory), memory_mask=mask)
    caches, steps = m.decoder.empty_caches(2, memory), []
    for t in range(4):
        x, caches, _ = m.decoder(tgt[:, t : t + 1], t, caches=caches, memory_kv=m.memory_kv(memory), memory_mask=mask)
        steps.append(x)
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-5, rtol=1e-5)
    assert [c.k.size(2) for c in caches] == [4, 4]

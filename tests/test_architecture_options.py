"""The architecture options of pretrained models (ModelConfig.activation, layer_norm_eps,
scale_embeddings, type_vocab_size, embedding_norm), each against a computation written out here
with torch's plain operations; the paper's defaults add nothing and change nothing."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.config import CLS, ModelConfig
from qkv.errors import ConfigError
from qkv.models import build_model
from qkv.nn.feed_forward import PositionwiseFeedForward
from qkv.nn.layers import EncoderLayer

D = 16
ENC = ModelConfig(task="mlm", d_model=D, n_heads=2, d_ff=32, n_encoder_layers=2, dropout=0.0, attention_dropout=0.0,
                  positional="learned", max_positions=32, src_vocab_size=40, tgt_vocab_size=40)

BY_HAND = {
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1 + torch.exp(-x)),
}


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * norm.weight + norm.bias


@pytest.mark.parametrize("activation", sorted(BY_HAND))
def test_each_activation_is_its_formula(activation):
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(D, 32, activation=activation)
    x = torch.randn(2, 5, D) * 3
    want = BY_HAND[activation](x @ ffn.w_1.weight.T + ffn.w_1.bias) @ ffn.w_2.weight.T + ffn.w_2.bias
    torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ffn.eval_forward(x), want, atol=1e-5, rtol=1e-5)
    if activation != "relu":  # the option is used: the paper's ReLU gives another result
        assert not torch.allclose(ffn(x), BY_HAND["relu"](x @ ffn.w_1.weight.T + ffn.w_1.bias) @ ffn.w_2.weight.T
                                  + ffn.w_2.bias, atol=1e-3)


@pytest.mark.parametrize("norm_first", [False, True])
def test_an_encoder_layer_with_gelu_and_a_large_epsilon_equals_torch_written_out(norm_first):
    torch.manual_seed(1)
    eps = 0.5  # large enough that the default 1e-5 would give another result
    layer = EncoderLayer(D, 2, 32, 0.0, 0.0, norm_first, activation="gelu", layer_norm_eps=eps).eval()
    for norm in (layer.res_attn.norm, layer.res_ffn.norm):
        assert norm.eps == eps
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    mha = torch.nn.MultiheadAttention(D, 2, batch_first=True)
    mha.in_proj_weight.data.copy_(layer.self_attn.in_proj.weight)
    mha.in_proj_bias.data.copy_(layer.self_attn.in_proj.bias)
    mha.out_proj.load_state_dict(layer.self_attn.out_proj.state_dict())
    x = torch.randn(2, 6, D) * 0.3
    ffn = lambda h: BY_HAND["gelu"](h @ layer.ffn.w_1.weight.T + layer.ffn.w_1.bias) @ layer.ffn.w_2.weight.T \
        + layer.ffn.w_2.bias
    n1 = lambda h: layer_norm(h, layer.res_attn.norm, eps)
    n2 = lambda h: layer_norm(h, layer.res_ffn.norm, eps)
    if norm_first:
        h = x + mha(n1(x), n1(x), n1(x), need_weights=False)[0]
        want = h + ffn(n2(h))
    else:
        h = n1(x + mha(x, x, x, need_weights=False)[0])
        want = n2(h + ffn(h))
    got, _, _ = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bert_embeddings_unscaled_with_token_types_and_a_norm():
    cfg = ModelConfig(**{**ENC.__dict__, "scale_embeddings": False, "type_vocab_size": 2, "embedding_norm": True,
                         "layer_norm_eps": 1e-12})
    torch.manual_seed(2)
    model = build_model(cfg).eval()
    torch.nn.init.normal_(model.embed_norm.weight)
    torch.nn.init.normal_(model.embed_norm.bias)
    tokens = torch.tensor([[CLS, 9, 10, 11], [CLS, 12, 0, 0]])
    want = model.src_embed.weight[tokens] + model.src_pos.weight[:4] + model.src_types.weight[0]
    want = layer_norm(want, model.embed_norm, 1e-12)
    torch.testing.assert_close(model.encoder.inputs(tokens), want, atol=1e-5, rtol=1e-5)
    assert model.embed_norm.eps == 1e-12 and model.mlm_head.norm.eps == 1e-12
    assert all(layer.res_attn.norm.eps == 1e-12 for layer in model.encoder_layers)


def test_scaled_embeddings_are_the_papers_default():
    torch.manual_seed(3)
    model = build_model(ENC).eval()
    tokens = torch.tensor([[CLS, 9, 10]])
    want = model.src_embed.weight[tokens] * math.sqrt(D) + model.src_pos.weight[:3]
    torch.testing.assert_close(model.encoder.inputs(tokens), want)


@pytest.mark.parametrize("task", ["translate", "mlm", "lm"])
def test_the_defaults_add_no_weights_and_change_no_output(task):
    """Every option set to its default by name builds the same modules with the same outputs as
    the config that never names them."""
    base = ModelConfig(**{**ENC.__dict__, "task": task})
    named = ModelConfig(**{**base.__dict__, "activation": "relu", "layer_norm_eps": 1e-5, "scale_embeddings": True,
                           "type_vocab_size": 0, "embedding_norm": False})
    torch.manual_seed(4)
    a = build_model(base).eval()
    b = build_model(named).eval()
    b.load_state_dict(a.state_dict())  # strict: the same parameter names
    assert not any(k.startswith(("src_types", "embed_norm")) for k in a.state_dict())
    tokens = torch.tensor([[CLS, 9, 10, 11], [CLS, 12, 13, 0]])
    if task == "translate":
        run = lambda m: m(tokens, tokens)
    else:
        run = lambda m: m(tokens)
    assert torch.equal(run(a), run(b))


@pytest.mark.parametrize("field,value,match", [
    ("activation", "gelu_new", "unknown activation 'gelu_new'"),
    ("layer_norm_eps", 0.0, "must be a number from"),
    ("layer_norm_eps", 2.0, "must be a number from"),
    ("type_vocab_size", 5000, "must be a whole number from 0 to 1024"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=f"'{field}'.*{match}"):
        ModelConfig(**{**ENC.__dict__, field: value}).validate()


@pytest.mark.parametrize("field,value", [("type_vocab_size", 2), ("embedding_norm", True), ("embedding_dim", 16),
                                         ("layer_groups", 1)])
def test_encoder_only_options_are_refused_elsewhere(field, value):
    for task in ("translate", "lm"):
        if (field, task) == ("embedding_norm", "translate"):  # BART's layernorm_embedding: each stack has one
            ModelConfig(**{**ENC.__dict__, "task": task, field: value}).validate()
            continue
        with pytest.raises(ConfigError, match=f"'{field}': only the Transformer encoder of classify and mlm"):
            ModelConfig(**{**ENC.__dict__, "task": task, field: value}).validate()


@pytest.mark.parametrize("field,value,match", [
    ("position_offset", 2, "offsets a learned position table"),
    ("layer_groups", 3, "3 sets of weights for 2 layers"),
    ("pooler_activation", "sigmoid", "must be one of tanh, relu, gelu"),
    ("mlm_head_activation", "tanh", "must be one of relu, gelu, gelu_tanh, silu"),
])
def test_family_switches_refuse_what_they_cannot_be(field, value, match):
    with pytest.raises(ConfigError, match=f"'{field}'.*{match}"):
        ModelConfig(**{**ENC.__dict__, "positional": "sinusoidal", "n_encoder_layers": 2, field: value}).validate()


def _with_options(tmp_path, **options):
    import shutil
    from pathlib import Path

    from qkv.checkpoint import read_checkpoint, save_checkpoint

    fixture = Path(__file__).parent / "fixtures" / "checkpoints" / "translate-transformer"
    ckpt = read_checkpoint(fixture)
    config = {**ckpt.config, "model": {**ckpt.config["model"], **options}}
    model = build_model(ModelConfig(**config["model"]))
    model.load_state_dict(ckpt.state_dict)
    out = tmp_path / "_".join(f"{k}-{v}" for k, v in options.items())
    save_checkpoint(out, model, config, write_extra=lambda d: shutil.copy(fixture / "spm.model", d))
    return out


def test_hf_export_refuses_an_option_its_format_does_not_write(tmp_path):
    from qkv.errors import QkvError
    from qkv.export import export

    with pytest.raises(QkvError, match="has activation = 'gelu': --format hf writes 'relu', 'silu' only"):
        export(_with_options(tmp_path, activation="gelu"), "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options", [{"activation": "gelu"}, {"activation": "gelu_tanh", "scale_embeddings": False,
                                                                "layer_norm_eps": 1e-6}])
def test_ctranslate2_export_writes_gelu_unscaled_embeddings_and_another_epsilon(tmp_path, options):
    """What an imported GPT-2 needs: the export's own check scores probe sequences with the converted model
    and with the checkpoint in PyTorch (|delta log p| < 1e-3, else it refuses): a wrong mapping fails here."""
    pytest.importorskip("ctranslate2", reason='pip install -c constraints.txt -e ".[export]"')
    from qkv.export import export

    info = export(_with_options(tmp_path, **options), "ctranslate2", tmp_path / "out")
    assert info["verified"]["checked"] and info["verified"]["max_abs_log_prob_difference"] < 1e-4, info["verified"]

"""Folders of BERT-like encoder families for the import tests: a tiny model of a transformers class with
random weights (transformers' own initialisation, then noise on every tensor so that no LayerNorm is the
identity and no bias is zero), its tokenizer.json built with the tokenizers library (a family's own kind of
model and post-processor), saved with save_pretrained; and the comparisons every family's test makes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -c constraints.txt -e '.[export]'")
tokenizers = pytest.importorskip("tokenizers", reason="pip install -c constraints.txt -e '.[pretrained]'")

import qkv  # noqa: E402

def sentence_transformers_layout(path, dim: int) -> None:
    """Beside a transformers model saved in ``path``: modules.json, a mean Pooling of ``dim`` and a Normalize,
    as sentence-transformers lays a folder out."""
    import json

    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dim, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "2_Normalize").mkdir()


TEXTS = ["The café's crème brûlée was naïve.", "東京は日本の首都です 🤖", "a",
         "pneumonoultramicroscopicsilicovolcanoconiosis is a long word, is it not?"]
TRAIN = TEXTS + ["the quick brown fox jumps over the lazy dog"] * 3


def byte_bpe(specials: list[str], post, texts: list[str] = TRAIN) -> "tokenizers.Tokenizer":
    """A byte-level BPE (RoBERTa's kind) with ``specials`` first, in order, and the post-processor ``post``,
    learned from ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = post(tok)
    return tok


def unigram(specials: list[str], post) -> "tokenizers.Tokenizer":
    """A SentencePiece-style Unigram model (XLM-R's, ALBERT's kind) with ``specials`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TRAIN, trainers.UnigramTrainer(vocab_size=200, special_tokens=specials,
                                                           unk_token=specials[specials.index("<unk>")]))
    tok.post_processor = post(tok)
    return tok


def wordpiece(specials: list[str], post) -> "tokenizers.Tokenizer":
    """BERT's lower-cased WordPiece with ``specials`` first."""
    from tokenizers.implementations import BertWordPieceTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(TRAIN, vocab_size=200, special_tokens=specials)
    tok = wp._tokenizer
    tok.post_processor = post(tok)
    return tok


def roberta_processing(tok):
    from tokenizers import processors

    return processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))


def template(cls: str, sep: str):
    def post(tok):
        from tokenizers import processors

        return processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                             special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    return post


def sequence(*steps):
    def post(tok):
        from tokenizers import processors

        return processors.Sequence([step(tok) for step in steps])
    return post


def byte_level(tok):
    from tokenizers import processors

    return processors.ByteLevel(trim_offsets=False)


def save_folder(path, model_class, config, tok, names: dict, noise: float = 0.05):
    """``model_class(config)`` with random weights and noise, and ``tok`` with its special ``names``, saved."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in names.items()})
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path, model.eval(), fast


def batch(tok, texts=TEXTS):
    enc = tok(texts, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # padded on the right
    enc.pop("token_type_ids", None)
    return enc


def qkv_tokens(loaded, texts=TEXTS):
    """The (B, T) batch qkv's frontend builds: each row the model's specials around the tokens, + PAD."""
    from qkv.tasks.classify import encoder_input

    return encoder_input(loaded._ids(texts))


def imported(folder, tmp_path):
    from qkv.importers import import_model

    out = tmp_path / ("q-" + folder.name)
    import_model(folder, out, log=lambda s: None)
    return qkv.load(out)


def check_same_tokens(loaded, tok):
    enc = batch(tok)
    tokens = qkv_tokens(loaded)
    back = torch.tensor([[m if m is not None else -1 for m in loaded.tokenizers.src.to_model_ids(row)]
                         for row in tokens.tolist()])
    back[tokens == 0] = tok.pad_token_id
    assert torch.equal(back, enc["input_ids"])  # the same tokens, the same specials, padded alike
    return enc, tokens


def max_hidden_difference(loaded, ref, tok) -> float:
    enc, tokens = check_same_tokens(loaded, tok)
    with torch.no_grad():
        want = ref(**enc).last_hidden_state
        h, _, _ = loaded.model.encode(tokens)
    return float((h - want)[enc["attention_mask"].bool()].abs().max())


def max_mlm_difference(loaded, ref, tok) -> float:
    enc, tokens = check_same_tokens(loaded, tok)
    with torch.no_grad():
        want = ref(**enc).logits  # (B, T, V) in the model's ids
        got = loaded.model(tokens)  # (B, T, V') in qkv's
    model_ids = loaded.tokenizers.src.to_model_ids(range(got.size(-1)))
    cols = [q for q, m in enumerate(model_ids) if m is not None]
    real = enc["attention_mask"].bool()
    return float((got[..., cols] - want[..., [model_ids[q] for q in cols]])[real].abs().max())


def check_fill(loaded, ref, tok, text="the quick [MASK] fox"):
    """qkv's fill of ``text`` (qkv writes [MASK] for every model) against the reference's top 3 and probabilities."""
    fills = loaded.fill(text, k=3)
    enc = tok([text.replace("[MASK]", tok.mask_token)], return_tensors="pt")
    enc.pop("token_type_ids", None)
    with torch.no_grad():
        p = ref(**enc).logits[0, enc["input_ids"][0].tolist().index(tok.mask_token_id)].softmax(-1)
    special = set(tok.all_special_ids)
    top = [(i, float(p[i])) for i in p.argsort(descending=True).tolist() if i not in special][:3]
    remap = loaded.tokenizers.src.ids.to_qkv  # the model's ids -> qkv's rows
    assert [word for word, _ in fills[0]] == [loaded.tokenizers.src.piece_text(remap[i]) for i, _ in top]
    for (_, got), (_, want) in zip(fills[0], top):
        assert abs(got - want) < 1e-5


def max_classify_difference(loaded, ref, tok) -> float:
    _, tokens = check_same_tokens(loaded, tok)
    with torch.no_grad():
        want = ref(**batch(tok)).logits
        got = loaded.model.eval()(tokens)
    torch.testing.assert_close(loaded.probabilities(TEXTS), want.softmax(-1), atol=1e-5, rtol=0)
    return float((got - want).abs().max())

"""The embedded default task: English number words -> German number words.

A translation task generated in code, so that ``qkv`` can train and be tested without
downloading anything, yet one with real structure: German reorders the units before the tens
("twenty-one" -> "einundzwanzig"), writes a number as one word, and inflects "eins"/"ein".

    english(321) == "three hundred twenty-one"
    german(321)  == "dreihunderteinundzwanzig"

Numbers run from 1 to 999 999; the embedded default draws its splits per number length (:func:`magnitude_numbers`).
"""

from __future__ import annotations

import random

from qkv.errors import QkvError

MAX_NUMBER = 999_999

_EN_UNITS = [
    "", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
]
_EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

_DE_UNITS = [
    "", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn",
    "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn",
]
_DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]


def _check_range(n: int) -> None:
    if not 1 <= n <= MAX_NUMBER:
        raise ValueError(f"number words are defined for 1..{MAX_NUMBER}, got {n}")


# --- English ---------------------------------------------------------------------------------------

def _english_below_1000(n: int) -> str:
    """1..999 -> e.g. "three hundred twenty-one" (American style, no "and")."""
    hundreds, rest = divmod(n, 100)
    words = []
    if hundreds:
        words.append(f"{_EN_UNITS[hundreds]} hundred")
    if 0 < rest < 20:
        words.append(_EN_UNITS[rest])
    elif rest >= 20:
        tens, units = divmod(rest, 10)
        words.append(_EN_TENS[tens] + (f"-{_EN_UNITS[units]}" if units else ""))
    return " ".join(words)


def english(n: int) -> str:
    """1..999999 in English words: 321 -> "three hundred twenty-one", 1005 -> "one thousand five"."""
    _check_range(n)
    thousands, rest = divmod(n, 1000)
    words = []
    if thousands:
        words.append(f"{_english_below_1000(thousands)} thousand")
    if rest:
        words.append(_english_below_1000(rest))
    return " ".join(words)


# --- German ----------------------------------------------------------------------------------------

def _german_below_1000(n: int, final: bool) -> str:
    """1..999 as one German word.

    A one standing alone in the last two places is "eins" at the very end of the whole number
    (``final``) and "ein" before "tausend": "eins", "einhunderteins", but "eintausend",
    "einhunderteintausend". Before "und" and "hundert" it is always "ein": "einundzwanzig",
    "einhundert".
    """
    hundreds, rest = divmod(n, 100)
    word = ""
    if hundreds:
        word += ("ein" if hundreds == 1 else _DE_UNITS[hundreds]) + "hundert"
    if rest == 1:
        word += "eins" if final else "ein"
    elif rest < 20:
        word += _DE_UNITS[rest]
    else:
        tens, units = divmod(rest, 10)
        if units:
            word += ("ein" if units == 1 else _DE_UNITS[units]) + "und"
        word += _DE_TENS[tens]
    return word


def german(n: int) -> str:
    """1..999999 in German words: 321 -> "dreihunderteinundzwanzig", 1001 -> "eintausendeins"."""
    _check_range(n)
    thousands, rest = divmod(n, 1000)
    word = ""
    if thousands:
        word += _german_below_1000(thousands, final=False) + "tausend"
    if rest:
        word += _german_below_1000(rest, final=True)
    return word


# --- data set --------------------------------------------------------------------------------------

def number_pairs(
    max_number: int = MAX_NUMBER,
    n_train: int = 20_000,
    n_valid: int = 500,
    n_test: int = 500,
    seed: int = 1,
) -> dict[str, list[tuple[str, str]]]:
    """(english, german) pairs for ``train``/``valid``/``test``; no number is in two splits.

    The numbers are drawn without replacement from 1..max_number by a generator seeded with
    ``seed``, so the same arguments always give the same splits.
    """
    if not 1 <= max_number <= MAX_NUMBER:
        raise QkvError(f"toy task: max_number must be in 1..{MAX_NUMBER}, got {max_number}")
    total = n_train + n_valid + n_test
    if min(n_train, n_valid, n_test) < 0 or total > max_number:
        raise QkvError(
            f"toy task: cannot draw {n_train} + {n_valid} + {n_test} distinct numbers from 1..{max_number}"
        )
    numbers = random.Random(seed).sample(range(1, max_number + 1), total)
    splits = {
        "train": numbers[:n_train],
        "valid": numbers[n_train : n_train + n_valid],
        "test": numbers[n_train + n_valid :],
    }
    return {name: [(english(n), german(n)) for n in chosen] for name, chosen in splits.items()}


# --- the recipe `qkv train` uses when no data is given ---------------------------------------------

# The embedded default covers every magnitude, not only the long numbers a uniform draw from
# 1..999,999 gives (99.9% of them have four or more digits): its splits are drawn per class of
# number length. The held-out test and validation numbers of a class are drawn first; training uses
# the rest of the class, repeated where the class has fewer numbers than training pairs (there are
# only 99 one- and two-digit numbers), so no test or validation number is ever seen in training.
# Batches hold a token budget, so a short number costs little: the short classes get many pairs,
# or the few batches of them would be too few updates to learn them from.
# The 27 numbers written as one English word (one..nineteen, twenty, thirty, ..., ninety) are never
# held out: they are the words every other number is made of, so the held-out one- and two-digit
# numbers are compounds ("seventy-six").
MAGNITUDES = (("1-2 digits", 1, 99), ("3 digits", 100, 999), ("4-5 digits", 1_000, 99_999),
              ("6 digits", 100_000, 999_999))
DEFAULT_TRAIN = (8_000, 3_000, 7_000, 9_000)  # training pairs per class (27,000; short ones cost few tokens)
DEFAULT_VALID = (8, 40, 72, 80)  # validation numbers per class (200)
DEFAULT_TEST = (16, 200, 200, 200)  # held-out test numbers per class (616)


def one_word(n: int) -> bool:
    """Whether ``n`` is one English word: 1..19 and the tens, 20..90 ("seventy", not "seventy-six")."""
    return " " not in english(n) and "-" not in english(n)


def magnitude(n: int) -> str:
    """The class of ``n`` in :data:`MAGNITUDES`: 7 -> "1-2 digits", 4321 -> "4-5 digits"."""
    _check_range(n)
    return next(name for name, lo, hi in MAGNITUDES if lo <= n <= hi)


def magnitude_numbers(
    train: tuple[int, ...] = DEFAULT_TRAIN,
    valid: tuple[int, ...] = DEFAULT_VALID,
    test: tuple[int, ...] = DEFAULT_TEST,
    seed: int = 1,
) -> dict[str, list[int]]:
    """Numbers for ``train``/``valid``/``test``, so many of each class of :data:`MAGNITUDES`.

    In each class the test numbers are drawn first, then the validation numbers, both distinct, from
    no other split and never a :func:`one_word` number; the training numbers are the class's others,
    drawn without replacement while there are enough, else every one of them, repeated in turn up to
    the count asked for. Each split is shuffled; the same arguments always give the same splits.
    """
    counts = {"train": train, "valid": valid, "test": test}
    for split, row in counts.items():
        if len(row) != len(MAGNITUDES) or min(row) < 0:
            raise QkvError(f"toy task: {split} needs {len(MAGNITUDES)} counts >= 0 (one per class: "
                           f"{', '.join(name for name, _, _ in MAGNITUDES)}), got {row}")
    rng = random.Random(seed)
    splits: dict[str, list[int]] = {"train": [], "valid": [], "test": []}
    for k, (name, lo, hi) in enumerate(MAGNITUDES):
        words = [n for n in range(lo, min(hi, 99) + 1) if one_word(n)]  # in training, never held out
        others = range(lo, hi + 1) if not words else [n for n in range(lo, hi + 1) if not one_word(n)]
        n_test, n_valid, n_train = test[k], valid[k], train[k]
        if n_test + n_valid > len(others) or (n_train and n_test + n_valid == len(words) + len(others)):
            raise QkvError(f"toy task: {name} has {len(others)} numbers to hold out: cannot hold out "
                           f"{n_test} + {n_valid} and train on any left")
        drawn = rng.sample(others, min(len(others), n_test + n_valid + n_train))
        if words:  # two-digit compounds: held out evenly across the tens, so that every ten keeps most
            drawn = _round_robin(drawn, key=lambda n: n // 10)  # of its compounds in training
        splits["test"] += drawn[:n_test]
        splits["valid"] += drawn[n_test : n_test + n_valid]
        rest = words + drawn[n_test + n_valid :]
        rest = rest if len(rest) <= n_train else rng.sample(rest, n_train)
        splits["train"] += [rest[i % len(rest)] for i in range(n_train)]
    for numbers in splits.values():
        rng.shuffle(numbers)
    return splits


def _round_robin(numbers: list[int], key) -> list[int]:
    """``numbers`` reordered to take one of each ``key`` in turn (in order of first appearance), so that
    any prefix holds each key about equally often: [21, 25, 33, 24, 38] -> [21, 33, 25, 38, 24]."""
    groups: dict[int, list[int]] = {}
    for n in numbers:
        groups.setdefault(key(n), []).append(n)
    order = list(groups.values())
    return [g[i] for i in range(max(map(len, order), default=0)) for g in order if i < len(g)]


def default_numbers() -> dict[str, list[int]]:
    """The embedded default's numbers: 27,000 training pairs, 200 validation, 616 held-out test."""
    return magnitude_numbers()


def default_splits() -> dict[str, list[tuple[str, str]]]:
    """The embedded default's data as (english, german) pairs."""
    return {split: [(english(n), german(n)) for n in numbers] for split, numbers in default_numbers().items()}


def _recipe():
    from qkv.config import ModelConfig, TrainConfig

    model = ModelConfig(
        d_model=128, n_heads=4, d_ff=512, n_encoder_layers=2, n_decoder_layers=2,
        dropout=0.1, attention_dropout=0.0, max_positions=128,
    )
    train = TrainConfig(
        tokenizer="bpe", vocab_size=300, joint_vocab=True, max_len=64, max_tokens=2048,
        lr_scale=0.5, warmup_steps=300, label_smoothing=0.1, clip_norm=1.0,
        max_steps=900, cooldown_steps=300, eval_every=300, eval_bleu_samples=200, seed=1,
    )
    return model, train


MODEL, TRAIN = _recipe()

# Recurrent models (--arch lstm|gru|rnn) on the same task: the same model sizes and batches, Adam at a
# constant rate instead of the Transformer's warmup schedule (what qkv.config.layered gives the recipe
# when the model is recurrent and no file or flag chooses a schedule).
RNN_SCHEDULE = {"schedule": "constant", "lr": 2e-3}


def _rnn_train():
    from qkv.config import override

    return override(TRAIN, RNN_SCHEDULE, "the embedded task's recurrent recipe").validate()


RNN_TRAIN = _rnn_train()


# The numbers the closing line of `qkv train` (and the README) invites a user to try.
TRY_IT = ("seven", "twenty-one", "three hundred twenty-one", "four thousand three hundred twenty-one")


def small_numbers_report(hyps: dict[int, str]) -> list[str]:
    """The lines of :func:`held_out_report` on every number of 1..99 (``hyps``: number -> translation):
    how many are right, how many were seen in training (the one-word numbers always are), and each
    wrong one, marked seen or held out."""
    numbers = default_numbers()
    seen, held_out = set(numbers["train"]), set(numbers["valid"]) | set(numbers["test"])
    small = range(1, 100)
    right = sum(hyps[n] == german(n) for n in small)
    n_seen = sum(n in seen for n in small)
    lines = [f"every number 1-99: {right}/99 right ({n_seen} seen in training, among them all "
             f"{sum(map(one_word, small))} one-word numbers; {sum(n in held_out for n in small)} held out)"]
    for n in small:
        if hyps[n] != german(n):
            where = "one-word, seen in training" if one_word(n) else "seen in training" if n in seen else "held out"
            lines.append(f"  ERR {english(n):<55} -> {hyps[n]}   (expected {german(n)}; {where})")
    return lines


def held_out_report(model, out) -> str:
    """After training on the embedded default: exact match on the held-out test numbers, overall and
    per class of :data:`MAGNITUDES`, two translations of each class, every number of 1..99 (one-word
    numbers are always in training, so the held-out classes cannot show them) and the numbers of the
    closing ``try it:`` line (``model``: the trained translator, e.g. ``qkv.load(out / "best")``)."""
    from qkv.metrics import exact_match

    numbers = default_numbers()["test"]
    src, refs = [english(n) for n in numbers], [german(n) for n in numbers]
    small = list(range(1, 100))
    tried = [n for n in (_value(p) for p in TRY_IT)]
    all_hyps = translate_capped(model, src + [english(n) for n in small] + list(TRY_IT),
                                refs + [german(n) for n in small + tried])
    hyps = all_hyps[: len(src)]
    small_hyps = dict(zip(small, all_hyps[len(src) : len(src) + len(small)]))
    tried_hyps = all_hyps[len(src) + len(small) :]
    lines = [f"held-out test: {100 * exact_match(hyps, refs):.1f}% exact match on {len(src)} numbers never seen "
             f"in training (beam {model.decode_cfg.beam_size})"]
    examples = []
    for name, _, _ in MAGNITUDES:
        rows = [i for i, n in enumerate(numbers) if magnitude(n) == name]
        right = sum(hyps[i] == refs[i] for i in rows)
        lines.append(f"  {name:<10} {100 * right / len(rows):5.1f}% ({right}/{len(rows)})" if rows else
                     f"  {name:<10} none held out")
        examples += rows[:2]
    lines += [_example_line(src[i], hyps[i], refs[i]) for i in examples]
    lines += small_numbers_report(small_hyps)
    lines.append("the numbers to try:")
    lines += [_example_line(p, h, german(n)) for p, h, n in zip(TRY_IT, tried_hyps, tried)]
    lines.append(f"try it: qkv translate {out}/best " + " ".join(f'"{p}"' for p in TRY_IT))
    return "\n".join(lines)


def translate_capped(model, sources: list[str], refs: list[str], a: int = 2, b: int = 5) -> list[str]:
    """``model.translate(sources)`` with each output capped at ``a`` x its reference's tokens + ``b``: an output
    that long is wrong whatever follows, and an untrained model that never ends would otherwise decode its
    whole budget (source + 50 tokens) with beam 4 on every number (45 s after a 3-update run). Sentences
    of one cap are decoded together."""
    caps = [a * len(ids) + b for ids in model.tokenizers.tgt.encode(refs)]
    out: list[str] = [""] * len(sources)
    for cap in sorted(set(caps)):
        rows = [i for i, c in enumerate(caps) if c == cap]
        for i, hyp in zip(rows, model.translate([sources[i] for i in rows], max_len_a=0.0, max_len_b=cap)):
            out[i] = hyp
    return out


def _example_line(src: str, hyp: str, ref: str) -> str:
    return f"  {'ok ' if hyp == ref else 'ERR'} {src:<55} -> {hyp}" + ("" if hyp == ref else f"   (expected {ref})")


def _value(phrase: str) -> int:
    """The number of an English phrase of :data:`TRY_IT` (by search: they are few and small)."""
    return next(n for n in range(1, 10_000) if english(n) == phrase)

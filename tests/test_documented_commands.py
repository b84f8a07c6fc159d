"""The first command of each documentation page runs as written.

For README.md and every docs/*.md page, the first command line of its ```bash blocks that starts with
``qkv`` (continuation lines joined; a ``... && qkv ...`` line counts from its ``qkv``) is run through
``qkv.cli.main`` in a temporary folder holding the files it names: tiny data the test writes, or a
fixture checkpoint where it names a trained one. Only flags are appended, never changed: ``qkv train``
gets a few updates and a tiny model (the last of repeated flags wins), so a recipe or preset change that
breaks a page's first command fails here, whatever the page's own numbers are.

A page whose first command cannot run here is in SKIPPED with the reason; a page that gains a first
command must be given its files here (SETUP) or a reason, or this test fails.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from qkv.cli import main

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SKIPPED = {
    "lab.md": "qkv lab serves a page until it is stopped; tests/test_lab*.py start it and train through it",
    "serving.md": "qkv serve serves until it is stopped; tests/test_serve.py starts it on a fixture checkpoint",
}

# a few updates of a tiny model; on the embedded task the recipe's own model (1M parameters) is kept
QUICK = ["--max-steps", "3", "--eval-every", "3", "--threads", "1", "--eval-bleu-samples", "8"]
TINY = ["--d-model", "32", "--n-heads", "2", "--d-ff", "64", "--n-encoder-layers", "1", "--n-decoder-layers", "1",
        "--max-tokens", "512", "--vocab-size", "60"]


def first_command(page: Path) -> list[str] | None:
    """The page's first ``qkv`` command, as words (``$D`` and other variables left as written)."""
    text = page.read_text(encoding="utf-8")
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["qkv"]:
                    return words
    return None


def write(path: Path, lines: list[str], gz: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(line + "\n" for line in lines)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")


WORDS = "red blue green cat dog bird sun moon tree big old new".split()


def sentences(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) for _ in range(n)]


def parallel(folder: Path, names: dict[str, str], gz: bool = False) -> None:
    """Source files of word sequences and their reversals as targets, under the names the page uses."""
    for split, n in (("train", 200), ("valid", 20)):
        src = sentences(n, seed=len(split))
        write(folder / names[f"{split}.src"], src, gz)
        write(folder / names[f"{split}.tgt"], [" ".join(reversed(s.split())) for s in src], gz)


def checkpoint(name: str, at: Path) -> None:
    shutil.copytree(FIXTURES / name, at, ignore=shutil.ignore_patterns("ct2-*"))


def setup_classification(tmp: Path) -> list[str]:
    for name, n in (("train.jsonl", 120), ("valid.jsonl", 20)):
        texts = sentences(n, seed=n)
        write(tmp / name, [json.dumps({"text": t, "label": "pos" if "sun" in t else "neg"}) for t in texts])
    return QUICK + TINY


def setup_language_models(tmp: Path) -> list[str]:
    book = ["The Project Gutenberg eBook of a test", "*** START OF THE PROJECT GUTENBERG EBOOK ***",
            *sentences(150, seed=3), "*** END OF THE PROJECT GUTENBERG EBOOK ***", "licence text"]
    write(tmp / "timemachine.txt", book)
    return QUICK + TINY


def setup_translation(tmp: Path) -> list[str]:
    parallel(tmp, {"train.src": "train.en", "train.tgt": "train.de", "valid.src": "valid.en", "valid.tgt": "valid.de"})
    (tmp / "recipes").symlink_to(ROOT / "recipes")  # the page names recipes/... relative to the repository
    return QUICK + TINY


def setup_tuning_journal(tmp: Path) -> list[str]:
    data = tmp / "m30k"
    parallel(data, {"train.src": "train.en.gz", "train.tgt": "train.de.gz", "valid.src": "val.en.gz",
                    "valid.tgt": "val.de.gz"}, gz=True)
    (tmp / "recipes").symlink_to(ROOT / "recipes")
    os.environ["D"] = str(data)  # the page's $D; monkeypatched back by the test
    return QUICK + TINY


SETUP = {
    "README.md": lambda tmp: QUICK,  # qkv train --out runs/default: the embedded task
    "classification.md": setup_classification,
    "inference.md": lambda tmp: checkpoint("translate-transformer", tmp / "runs" / "ende" / "best") or [],
    "language-models.md": setup_language_models,
    "pretrained.md": None,  # the installed all-MiniLM-L6-v2 folder (the minilm_dir fixture)
    "recurrent.md": lambda tmp: QUICK,  # the embedded task
    "seeing-inside.md": lambda tmp: checkpoint("translate-transformer", tmp / "runs" / "default" / "best") or [],
    "training.md": lambda tmp: [],  # qkv info: no files
    "translation.md": setup_translation,
    "tuning-journal.md": setup_tuning_journal,
}


def test_every_page_with_a_command_is_run_or_skipped_with_a_reason():
    with_commands = {p.name for p in PAGES if first_command(p)}
    assert with_commands == set(SETUP) | set(SKIPPED), (
        f"pages to give files (SETUP) or a reason (SKIPPED): {sorted(with_commands ^ (set(SETUP) | set(SKIPPED)))}")
    assert not set(SETUP) & set(SKIPPED)
    assert first_command(ROOT / "docs" / "recurrent.md")[:5] == ["qkv", "train", "--arch", "lstm", "--attention"]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("name", sorted(SETUP))
def test_the_first_command_of_each_page_runs(name, tmp_path, monkeypatch, request, capsys):
    page = next(p for p in PAGES if p.name == name)
    words = first_command(page)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("D", "")
    if name == "pretrained.md":
        folder = request.getfixturevalue("minilm_dir")
        (tmp_path / "models").mkdir()
        (tmp_path / "models" / "all-MiniLM-L6-v2").symlink_to(folder)
        extra = []
    else:
        extra = SETUP[name](tmp_path)
    argv = [os.path.expandvars(w) for w in words[1:]] + (extra if words[1] == "train" else [])
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, f"{name}: `{shlex.join(words)}` exited {rc}:\n{err[-2000:]}"
    if words[1] == "train":
        out_dir = Path(argv[argv.index("--out") + 1]) if "--out" in argv else Path("runs/default")
        assert (out_dir / "best" / "model.safetensors").is_file(), f"{name}: no checkpoint in {out_dir}/best"

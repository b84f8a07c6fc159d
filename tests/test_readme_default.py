"""The README's first command, run here: the whole embedded default recipe (``qkv train --out
runs/default``, a few minutes on 2 cores), on the machine that runs the tests, whatever its CPU.

The model it trains must meet the floor in every class of number length of the held-out test
(>= 99%), translate every number of 1-99 (the one-word numbers are in training, so the held-out
classes cannot show them), print the README's example lines as the README shows them, and answer
the README's ``qkv translate runs/default/best ...`` with the lines shown under it. The stored
fixture of tests/test_default_task.py cannot catch a recipe that fails on another CPU; this does.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.data.toy import MAGNITUDES, TRY_IT, german

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mkdocs_hooks import readme_section  # noqa: E402 (the site's hook, beside mkdocs.yml)
README = (ROOT / "README.md").read_text(encoding="utf-8")
FLOOR = 99.0  # % exact match in every class of the held-out test


def first_command() -> list[str]:
    """The training half of the README's first command (``pip install ... && qkv train --out runs/default``)."""
    block = re.search(r"^```bash\n(.*?)^```", readme_section(README, "Set-up: two commands"), flags=re.M | re.S)
    first = next(line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#"))
    argv = shlex.split(first.split("&&")[-1])
    assert argv[:2] == ["qkv", "train"], first
    return argv


def shown_report() -> list[str]:
    """The closing report the README shows for that command."""
    block = re.search(r"^```\n(held-out test:.*?)^```", README, flags=re.M | re.S)
    return block.group(1).splitlines()


def shown_translations() -> tuple[list[str], list[str]]:
    """The README's ``$ qkv translate runs/default/best "..." ...`` and the lines shown under it."""
    m = re.search(r"^\$ (qkv translate runs/default/best .*)\n((?:\S+\n)+)```", README, flags=re.M)
    return shlex.split(m.group(1)), m.group(2).split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """The README's first command run in a fresh directory: (that directory, what it printed)."""
    cwd = tmp_path_factory.mktemp("user")
    argv = first_command()
    # OpenMP's workers sleep while they wait instead of spinning (unless the caller chose): on a machine busy
    # with other work, spinning workers make a 2-thread run many times slower; the arithmetic is the same
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    proc = subprocess.run([sys.executable, "-m", "qkv", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=3600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, proc.stdout


def test_the_readme_shows_the_command_and_its_report():
    assert first_command() == ["qkv", "train", "--out", "runs/default"]
    assert shown_report()[0].startswith("held-out test:") and any(line.startswith("every number 1-99:")
                                                                  for line in shown_report())
    argv, lines = shown_translations()
    assert argv[3:] == list(TRY_IT) and len(lines) == len(TRY_IT)


def test_every_class_of_the_held_out_test_meets_the_floor(trained):
    _, out = trained
    classes = re.findall(r"^  (\d(?:-\d)? digits) +([\d.]+)% \((\d+)/(\d+)\)$", out, flags=re.M)
    assert [name for name, *_ in classes] == [name for name, _, _ in MAGNITUDES], out
    low = [(name, right, total) for name, _, right, total in classes if 100 * int(right) / int(total) < FLOOR]
    assert not low, f"classes under {FLOOR}%: {low}\n{out}"


def test_every_number_of_1_to_99_is_right(trained):
    _, out = trained
    assert re.search(r"^every number 1-99: 99/99 right", out, flags=re.M), out


def test_the_example_lines_are_the_readmes(trained):
    """The ``ok`` lines the README shows (the first two held-out numbers of each class, the numbers to
    try) are printed as shown: the same numbers, translated right."""
    _, out = trained
    printed = {line.rstrip() for line in out.splitlines()}
    shown = [line.rstrip() for line in shown_report() if line.startswith("  ok  ")]
    assert len(shown) == 2 * len(MAGNITUDES) + len(TRY_IT)
    missing = [line for line in shown if line not in printed]
    assert not missing, f"README lines not printed:\n" + "\n".join(missing) + f"\n--- printed:\n{out}"
    assert not re.search(r"^  ERR ", out, flags=re.M), out


def test_the_readmes_translate_command_prints_what_it_shows(trained):
    cwd, _ = trained
    argv, lines = shown_translations()
    proc = subprocess.run([sys.executable, "-m", "qkv", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == lines
    assert lines == [german(n) for n in (7, 21, 321, 4321)]  # and what the README shows is German

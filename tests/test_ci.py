"""One test command for users and CI: the README's second command installs everything the suite uses and
runs it, and ``.ci/run`` runs exactly that command, after installing Chromium and a C++ compiler with apt
where they are missing (checked by running ``.ci/run`` against stand-ins for apt-get, pip and python)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mkdocs_hooks import readme_section  # noqa: E402 (the site's hook, beside mkdocs.yml)


def readme_test_command() -> str:
    block = re.search(r"^```bash\n(.*?)^```", readme_section((ROOT / "README.md").read_text(), "Set-up: two commands"),
                      flags=re.M | re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    return commands[1]


def test_ci_runs_the_readmes_test_command_exactly():
    command = readme_test_command()
    assert command == 'pip install -c constraints.txt -e ".[test]" && python -m pytest -q'
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert lines[-1] == command


def test_the_test_extra_holds_every_extra_a_test_names():
    """A test that skips without an optional package names the extra that installs it; the test extra
    (what the README's command installs) includes each of them, so none skips there."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    included = {name for req in extras["test"] for m in [re.fullmatch(r"qkv\[([\w,]+)\]", req)] if m
                for name in m.group(1).split(",")} | {"test"}
    named = {name for path in (ROOT / "tests").glob("*.py")
             for group in re.findall(r"\.\[([\w,]+)\]", path.read_text()) for name in group.split(",")}
    named |= {m for path in (ROOT / "tests").glob("*.py") for m in re.findall(r"qkv\[(\w+)\]", path.read_text())}
    assert named - {"viz"} <= included, named - included  # viz is matplotlib alone, itself in the test extra
    assert "matplotlib>=3.7" in extras["test"] and extras["viz"] == ["matplotlib>=3.7"]
    assert {"docs", "serve", "export", "tensorboard"} <= included


def _stand_ins(tmp_path: Path, present: list[str]) -> tuple[Path, Path]:
    """A PATH of stand-ins that log their arguments (apt-get, pip, python, and ``present``), and the log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ["apt-get", "pip", "python", *present]:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        (bin_dir / name).chmod(0o755)
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    return bin_dir, log


def _run_ci(bin_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "QKV_CHROMIUM"} | {"PATH": str(bin_dir)}
    subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "run")], env=env, check=True, timeout=60)


def test_ci_installs_chromium_and_a_compiler_with_apt_where_missing(tmp_path):
    bin_dir, log = _stand_ins(tmp_path, present=[])
    _run_ci(bin_dir)
    assert log.read_text().splitlines() == [
        "apt-get update", "apt-get install -y chromium g++",
        "pip install -c constraints.txt -e .[test]", "python -m pytest -q"]


def test_ci_installs_nothing_with_apt_where_both_are_there(tmp_path):
    bin_dir, log = _stand_ins(tmp_path, present=["chromium", "g++"])
    _run_ci(bin_dir)
    assert log.read_text().splitlines() == ["pip install -c constraints.txt -e .[test]", "python -m pytest -q"]

"""The tree passes the linter CI runs: ruff with the repository's configuration (pyproject.toml:
pyflakes, import order, lines of at most 130 characters)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    out = subprocess.run([*cmd, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"ruff check (pip install 'ruff==0.17.6') found:\n{out.stdout}{out.stderr}"

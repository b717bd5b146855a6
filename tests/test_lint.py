"""The lint step of CI: ``ruff check`` over the whole repository with the ``[tool.ruff]`` settings
in pyproject.toml (ruff comes with the ``dev`` extra that tools/setup.sh installs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    ruff = Path(sys.executable).parent / ("ruff.exe" if os.name == "nt" else "ruff")
    assert ruff.is_file(), f"{ruff} is missing: install the dev extra (bash tools/setup.sh, or pip install -e '.[dev]')"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"ruff check found problems (fix them, or `{ruff} check --fix .` for the "
                                  f"fixable ones):\n{proc.stdout}{proc.stderr}")

"""The linters are part of the suite: ruff (style and bugs), lint-imports (the layering of
docs/design.md, "Components and the direction of imports") and mypy (the pure modules,
strictly). Each runs as its own process from this interpreter's venv; a failure shows the tool's
output. Configuration: ``pyproject.toml``."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _typecheck_tree() -> None:
    runpy.run_path(str(REPO / "scripts" / "typecheck_tree.py"))["make_tree"](REPO)


LINTERS = {
    "ruff": ["ruff", "check", "--no-cache", "."],
    "lint-imports": ["lint-imports", "--no-logo", "--no-cache"],
    "mypy": ["mypy"],
}


@pytest.mark.parametrize("tool", sorted(LINTERS))
def test_linter_passes(tool: str) -> None:
    exe, *args = LINTERS[tool]
    path = BIN / exe
    assert path.exists(), f"{exe} is not installed next to {sys.executable} (run scripts/setup.sh)"
    if tool == "mypy":
        _typecheck_tree()
    proc = subprocess.run([str(path), *args], cwd=REPO, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join([exe, *args])} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}",
                    pytrace=False)
